"""Check a ``POST /v1/videos`` request (a JSON object, or the fields of a multipart form, where every value is
text) against the server's limits and the loaded model's rules, before anything is queued.

Fields follow OpenAI's video API (``prompt``, ``model``, ``seconds``, ``size`` as ``"WxH"``) and vLLM-Omni's
extras (``num_frames``, ``fps``, ``width`` / ``height``, ``num_inference_steps``, ``guidance_scale``,
``negative_prompt``, ``seed``), plus ``cache`` (a step-cache policy) and ``lora`` / ``lora_weight`` (a name from
the server's LoRA folder). Every refusal is a 400 whose ``param`` names the field.

The bounds themselves are not defined here: ``limits`` is the demo's (``apps.demo_limits.DemoLimits``, passed in by
the command line, which sits above this package) and the frame/size rules are ``video.rules.VideoRules``.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Any, Callable

from metainfer_gen.serve.errors import APIError, bad_request

# Fields a request may carry; anything else is refused (a typo must not silently render the default).
FIELDS = ("prompt", "model", "seconds", "fps", "num_frames", "size", "width", "height", "num_inference_steps",
          "guidance_scale", "negative_prompt", "seed", "cache", "lora", "lora_weight", "input_reference")
_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")
_LEADING_NAME = re.compile(r"^([a-z_]+)")
MAX_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class VideoRequest:
    """A checked request, as stored with its job and read by the worker.

    Attributes:
        prompt / negative_prompt: stripped text (None: no negative prompt). num_frames: frames of the clip;
        height / width: pixels; fps: frames per second of the MP4; seed: the generator's seed (drawn when the
        request gave none, and recorded, so the clip is reproducible); cache: a step-cache spec ("off": none);
        lora: ``(name, path, weight)`` or None; image: the stored reference image's file name in the upload
        folder, or None (text-to-video).
    """

    prompt: str
    negative_prompt: str | None
    num_frames: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    fps: float
    cache: str = "off"
    lora: tuple[str, str, float] | None = None
    image: str | None = None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def seconds(self) -> str:
        """Duration of the MP4 (frames / fps), as OpenAI's string."""
        return f"{self.num_frames / self.fps:g}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VideoRequest":
        lora = data.get("lora")
        return cls(**{**data, "lora": tuple(lora) if lora else None})


@dataclass(slots=True)
class RequestChecks:
    """What a request is checked against.

    Args:
        limits: an object with ``check_prompt``, ``check_video`` and ``check_image`` (``DemoLimits``); each raises
            ``ValueError`` naming the field.
        rules: the model's ``VideoRules`` (None until known: requests then get a 503).
        defaults: the model's default settings (``metainfer_gen.json``: num_frames, height, width, steps,
            guidance_scale, fps); a field neither given nor defaulted is a 400.
        model_name: the ``model`` clients may name (another name is a 400).
        cache_names: the accepted ``cache`` policies.
        lora: ``(name, weight) -> (path, weight)`` resolving a LoRA name inside the LoRA folder, raising
            ``ValueError``; None when the server has no LoRA folder.
        loading: True until a worker has loaded the model (a missing default is then a 503, not a 400).
    """

    limits: Any
    rules: Any
    defaults: dict[str, Any]
    model_name: str
    cache_names: tuple[str, ...]
    lora: Callable[[str, float], tuple[str, float]] | None = None
    loading: bool = True


def _param_of(message: str, fields: tuple[str, ...]) -> str | None:
    """The field a ValueError from the limits or the rules is about: they start with its name."""
    found = _LEADING_NAME.match(message)
    name = found.group(1) if found else None
    return name if name in fields else None


def _checked(call: Callable[[], Any], param: str | None = None):
    try:
        return call()
    except (ValueError, TypeError) as exc:
        message = str(exc)
        raise bad_request(message, param or _param_of(message, FIELDS)) from None


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise bad_request(f"{name} must be a number; got {value!r}", name) from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise bad_request(f"{name} must be a finite number; got {value!r}", name)
    return number


def parse_video_request(body: dict[str, Any], checks: RequestChecks, image: str | None = None) -> VideoRequest:
    """The checked request (``image``: the stored reference image's name, when one was uploaded).

    Raises:
        APIError: 400 naming the field (unknown field, missing prompt, a value outside the limits or the model's
            rules, an unknown model, cache policy or LoRA); 503 while the model's rules are not known yet.
    """
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}; accepted: {', '.join(FIELDS)}", unknown[0],
                          "unknown_parameter")
    if checks.rules is None:
        raise APIError(503, "the video model is still loading; retry in a few seconds", code="model_loading")
    model = body.get("model")
    if model not in (None, "", checks.model_name):
        raise APIError(400, f"the model {model!r} does not exist; this server renders {checks.model_name!r}",
                       param="model", code="model_not_found")
    limits = checks.limits
    if body.get("prompt") is None:
        raise bad_request("prompt is required: the text the clip should show", "prompt", "missing_field")
    prompt = _checked(lambda: limits.check_prompt(body.get("prompt")), "prompt")
    negative = _checked(lambda: limits.check_prompt(body.get("negative_prompt"), "negative_prompt",
                                                    required=False), "negative_prompt") or None
    fps = _number(body, "fps")
    fps = float(checks.defaults.get("fps", 8.0)) if fps is None else fps
    if not 0 < fps <= 120:
        raise bad_request(f"fps={fps:g} is outside 0..120", "fps")
    width, height = _size(body)
    values = {"num_frames": body.get("num_frames"), "height": height, "width": width,
              "num_inference_steps": body.get("num_inference_steps"), "guidance_scale": body.get("guidance_scale")}
    from_seconds = values["num_frames"] in (None, "") and _number(body, "seconds") is not None
    if from_seconds:
        values["num_frames"] = _frames_for(_number(body, "seconds"), fps, checks.rules.temporal_factor)
    for name, value in values.items():
        if value in (None, ""):
            if name not in checks.defaults and checks.loading:
                raise APIError(503, f"{name} was not given and the model's default is known once a worker has "
                                    "loaded it; retry in a few seconds", param=name, code="model_loading")
            if name not in checks.defaults:
                raise bad_request(f"{name} is required: this model has no default for it", name, "missing_field")
            values[name] = checks.defaults[name]
    seed = body.get("seed")
    seed = secrets.randbelow(2**31) if seed in (None, "") else seed
    try:
        checked = _checked(lambda: limits.check_video(seed=seed, **values))
        _checked(lambda: checks.rules.check_sizes(num_frames=checked["num_frames"], height=checked["height"],
                                                  width=checked["width"]))
    except APIError as exc:
        if exc.param in ("width", "height") and body.get("size") not in (None, ""):
            raise bad_request(f"size {body['size']!r}: {exc.message}", "size") from None
        if exc.param == "num_frames" and from_seconds:  # the request named seconds, not frames
            most = (limits.max_frames - 1) / fps
            raise bad_request(f"seconds={_number(body, 'seconds'):g} is {values['num_frames']} frames at {fps:g} "
                              f"fps ({exc.message}); ask at most {most:g} seconds, or set num_frames", "seconds") \
                from None
        raise
    cache = body.get("cache") or "off"
    if cache not in checks.cache_names:
        raise bad_request(f"unknown cache policy {cache!r}; choose one of {', '.join(checks.cache_names)}", "cache")
    return VideoRequest(prompt, negative, checked["num_frames"], checked["height"], checked["width"],
                        checked["num_inference_steps"], checked["guidance_scale"], checked["seed"], fps, cache,
                        _lora(body, checks), image)


def _size(body: dict) -> tuple[Any, Any]:
    """(width, height) from ``size`` ("WxH") or ``width`` / ``height`` (None where not given)."""
    size = body.get("size")
    if size in (None, ""):
        return body.get("width"), body.get("height")
    found = _SIZE.match(size) if isinstance(size, str) else None
    if found is None:
        raise bad_request(f"size must be 'WIDTHxHEIGHT', e.g. '64x64'; got {size!r}", "size")
    parsed = {"width": int(found.group(1)), "height": int(found.group(2))}
    for name, value in parsed.items():
        if body.get(name) not in (None, "") and _number(body, name) != value:
            raise bad_request(f"size {size!r} and {name}={body[name]!r} disagree: give one of them", name)
    return parsed["width"], parsed["height"]


def _frames_for(seconds: float, fps: float, temporal_factor: int) -> int:
    """The valid frame count (k * T + 1) nearest to ``seconds`` at ``fps``."""
    if not 0 < seconds <= MAX_SECONDS:
        raise bad_request(f"seconds={seconds:g} must be in (0, {MAX_SECONDS:g}]", "seconds")
    return max(0, round(seconds * fps / temporal_factor)) * temporal_factor + 1


def _lora(body: dict, checks: RequestChecks) -> tuple[str, str, float] | None:
    name = body.get("lora")
    weight = _number(body, "lora_weight")
    if name in (None, "", "none"):
        if weight is not None:
            raise bad_request(f"lora_weight={weight:g} is given without lora: name the LoRA it weighs (a file "
                              "in the server's --lora-dir), or leave lora_weight out", "lora_weight")
        return None
    if checks.lora is None:
        raise bad_request("this server has no LoRA folder (--lora-dir): lora cannot be used", "lora")
    try:  # the check's message starts with the field it is about (lora_weight), else it is about the name
        path, weight = checks.lora(name, 1.0 if weight is None else weight)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), _param_of(str(exc), FIELDS) or "lora") from None
    return str(name), str(path), float(weight)
