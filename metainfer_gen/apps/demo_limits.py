"""What the demo accepts from a browser: bounded inputs, checked before any work, and the LoRA-folder rule.

A public demo must not let one visitor ask for a 4K, 500-step clip or a 100 MB prompt, and must never read a
file path typed by a visitor. Everything here is plain Python (no gradio, no torch) so it is tested fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

# Suffixes of LoRA weight files that diffusers' ``load_lora_weights`` reads.
LORA_SUFFIXES = (".safetensors", ".bin")
MAX_LORA_WEIGHT = 2.0


class InputError(ValueError):
    """A request the demo refuses; the message says which input and the allowed range (shown to the user)."""


@dataclass(frozen=True, slots=True)
class DemoLimits:
    """Upper bounds on what one request may ask for.

    Attributes:
        max_frames: frames per clip. max_size: height and width, in pixels. max_steps: denoising steps.
        max_prompt_chars: characters in a prompt or negative prompt.
        max_image_pixels: width x height of an uploaded reference image (before fitting).
        max_upload_mb: size of one uploaded file, in MiB (enforced by the web server).
        max_new_tokens: tokens per LLM completion. max_queue: requests waiting per event before new ones are
            turned away.
    """

    max_frames: int = 33
    max_size: int = 256
    max_steps: int = 50
    max_prompt_chars: int = 500
    max_image_pixels: int = 25_000_000
    max_upload_mb: int = 20
    max_new_tokens: int = 256
    max_queue: int = 16

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DemoLimits.{name} must be an int >= 1; got {value!r}")

    def check_prompt(self, prompt: object, name: str = "prompt", required: bool = True) -> str:
        """The prompt stripped; InputError when missing (and required), not text, or longer than the limit."""
        if prompt is None:
            prompt = ""
        if not isinstance(prompt, str):
            raise InputError(f"{name} must be text; got {type(prompt).__name__}")
        prompt = prompt.strip()
        if required and not prompt:
            raise InputError(f"{name} is empty: type what the clip should show")
        if len(prompt) > self.max_prompt_chars:
            raise InputError(f"{name} is {len(prompt)} characters; this demo allows at most {self.max_prompt_chars}")
        return prompt

    def check_video(self, *, num_frames: object, height: object, width: object, num_inference_steps: object,
                    guidance_scale: object, seed: object) -> dict[str, object]:
        """Validate the shape/step controls against the limits; return them as ints/float.

        The model's own rules (``k*4+1`` frames, multiples of 16) are checked afterwards by the pipeline, whose
        errors already name the nearest valid values.

        Raises:
            InputError: a value that is not a whole number, or is outside the limits.
        """
        values = {name: _whole(name, value) for name, value in (
            ("num_frames", num_frames), ("height", height), ("width", width),
            ("num_inference_steps", num_inference_steps), ("seed", seed))}
        bounds = {"num_frames": self.max_frames, "height": self.max_size, "width": self.max_size,
                  "num_inference_steps": self.max_steps}
        for name, upper in bounds.items():
            if not 1 <= values[name] <= upper:
                raise InputError(f"{name}={values[name]} is outside this demo's range 1..{upper}")
        if not 0 <= values["seed"] < 2**63:
            raise InputError(f"seed={values['seed']} must be in 0..2**63-1")
        values["guidance_scale"] = _number("guidance_scale", guidance_scale, 0, 30)
        return values

    def check_image(self, image: object) -> None:
        """InputError when no image was given or it has more than ``max_image_pixels`` pixels."""
        if image is None:
            raise InputError("upload a reference image first")
        size = getattr(image, "size", None)
        if not (isinstance(size, tuple) and len(size) == 2):
            raise InputError(f"the reference image must be a picture; got {type(image).__name__}")
        if size[0] * size[1] > self.max_image_pixels:
            raise InputError(f"the image is {size[0]}x{size[1]} ({size[0] * size[1]:,} pixels); this demo accepts "
                             f"at most {self.max_image_pixels:,} pixels")

    def check_text_request(self, *, max_new_tokens: object, temperature: object) -> tuple[int, float]:
        """(max_new_tokens, temperature) validated: 1..max_new_tokens and 0..2."""
        tokens = _whole("max_new_tokens", max_new_tokens)
        if not 1 <= tokens <= self.max_new_tokens:
            raise InputError(f"max_new_tokens={tokens} is outside this demo's range 1..{self.max_new_tokens}")
        return tokens, _number("temperature", temperature, 0, 2)


def _number(name: str, value: object, low: float, high: float) -> float:
    """``value`` as a finite float in [low, high]."""
    if isinstance(value, bool):
        raise InputError(f"{name} must be a number; got {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number; got {value!r}") from None
    if not math.isfinite(number) or not low <= number <= high:
        raise InputError(f"{name}={value!r} is outside this demo's range {low:g}..{high:g}")
    return number


def _whole(name: str, value: object) -> int:
    """``value`` as an int; sliders and number boxes send floats such as 17.0. An int (or a string of digits) is
    taken exactly, never through a float (which rounds above 2**53: a seed of 2**63 - 1 would become 2**63)."""
    if isinstance(value, bool) or value is None:
        raise InputError(f"{name} must be a whole number; got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdecimal():  # what int() reads: no float rounding
        return int(value)
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a whole number; got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise InputError(f"{name} must be a whole number; got {value!r}")
    if abs(number) > 2**53:  # a float this large is already rounded: the number sent is not known
        raise InputError(f"{name} must be a whole number written as an integer past 2**53, not a float; "
                         f"got {value!r}")
    return int(number)


def list_loras(folder: str | Path | None) -> list[str]:
    """Names (paths relative to ``folder``, sorted) of the LoRA weight files the demo may offer.

    The demo's LoRA control (``metainfer-gen demo --lora-dir``) offers these names and nothing else. Files
    reached through a link that leaves the folder are not listed.

    Raises:
        FileNotFoundError: ``folder`` is given but is not a directory.
    """
    if folder is None:
        return []
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"LoRA folder {root} is not a directory")
    root = root.resolve()
    names = []
    for path in root.rglob("*"):
        if path.suffix.lower() in LORA_SUFFIXES and path.is_file() and path.resolve().is_relative_to(root):
            names.append(path.relative_to(root).as_posix())
    return sorted(names)


def resolve_lora(folder: str | Path, name: str) -> Path:
    """The file for a LoRA chosen by ``name`` inside ``folder``; never a path outside it.

    Args:
        folder: the LoRA folder the operator configured.
        name: one of :func:`list_loras`'s names, as sent by the browser (so untrusted).
    Raises:
        InputError: an absolute path, a name that leaves the folder (``..``, a link pointing out), a suffix
            that is not a LoRA file, or a file that does not exist.
    """
    if not isinstance(name, str) or not name.strip():
        raise InputError("choose a LoRA from the list")
    if Path(name).is_absolute() or "\\" in name or "\x00" in name:
        raise InputError(f"LoRA {name!r} refused: choose a name from the list, not a path")
    root = Path(folder).resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise InputError(f"LoRA {name!r} refused: it is outside the LoRA folder")
    if path.suffix.lower() not in LORA_SUFFIXES:
        raise InputError(f"LoRA {name!r} refused: only {', '.join(LORA_SUFFIXES)} files are LoRA weights")
    if not path.is_file():
        raise InputError(f"LoRA {name!r} does not exist in the LoRA folder")
    return path


def check_lora(folder: str | Path, name: str, weight: object) -> tuple[Path, float]:
    """``(file, weight)`` of a LoRA chosen by name (see :func:`resolve_lora`) at a weight in [-2, 2].

    Used by the demo and by the video server's requests (``lora``, ``lora_weight``).

    Raises:
        InputError: as :func:`resolve_lora`, or a weight that is not a number in [-2, 2].
    """
    path = resolve_lora(folder, name)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not abs(weight) <= MAX_LORA_WEIGHT:
        raise InputError(f"lora_weight (the LoRA's weight) must be a number in [-{MAX_LORA_WEIGHT:g}, "
                         f"{MAX_LORA_WEIGHT:g}]; got {weight!r}")
    return path, float(weight)
