"""Input rules of a loaded video model family, checked before any work is done.

Video DiTs constrain their inputs through the VAE's compression and the transformer's patch size: Wan, HunyuanVideo
and LTX-Video take ``num_frames = k * T + 1`` (T = the VAE's temporal compression: 4 for Wan, 8 for LTX), and
sizes that are multiples of the VAE's spatial compression times the patch size (Wan's own ``check_inputs``
also demands multiples of 16). Diffusers silently rounds some of these and crashes inside the model on others;
we refuse them up front with an error naming the rule and the nearest valid values.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Extra spatial multiples that a family's own check_inputs enforces beyond VAE factor x patch size.
_FAMILY_MIN_MULTIPLE = {"Wan": 16, "CogVideoX": 16}
MAX_PROMPT_CHARS = 4000


@dataclass(frozen=True, slots=True)
class VideoRules:
    """What a loaded pipeline accepts.

    Attributes:
        family: pipeline class name, e.g. ``"WanPipeline"``.
        temporal_factor: T in ``num_frames = k * T + 1`` (1 means any count >= 1).
        spatial_multiple: height and width must be multiples of this (pixels).
        max_size: largest height/width the transformer's position table covers (Wan's ``rope_max_seq_len``
            patches per axis), in pixels; None when unbounded.
        max_frames: likewise for ``num_frames``; None when unbounded.
    """

    family: str
    temporal_factor: int
    spatial_multiple: int
    max_size: int | None = None
    max_frames: int | None = None

    @classmethod
    def from_pipeline(cls, pipe) -> "VideoRules":
        """Read the rules from a diffusers pipeline's VAE and transformer configs."""
        temporal = (
            getattr(pipe, "vae_scale_factor_temporal", None)
            or getattr(pipe, "vae_temporal_compression_ratio", None)
            or 1
        )
        spatial = (
            getattr(pipe, "vae_scale_factor_spatial", None)
            or getattr(pipe, "vae_spatial_compression_ratio", None)
            or getattr(pipe, "vae_scale_factor", None)
            or 8
        )
        model = getattr(pipe, "transformer", None) or getattr(pipe, "transformer_2", None)
        config = getattr(model, "config", None)
        return cls._from_factors(type(pipe).__name__, temporal, spatial, getattr(config, "patch_size", 1),
                                 getattr(config, "rope_max_seq_len", None))

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "VideoRules | None":
        """The rules of a saved Wan pipeline folder, read from its JSON configs without loading any weights (so
        a command line can refuse a bad size before the load); None for another family or an unreadable folder
        (the rules are then read from the pipeline once it is loaded).

        Diffusers' Wan pipelines take their factors from the VAE config (``scale_factor_temporal``,
        ``scale_factor_spatial``), as read here.
        """
        path = Path(path)
        try:
            name = json.loads((path / "model_index.json").read_text())["_class_name"]
            vae = json.loads((path / "vae" / "config.json").read_text())
            transformer_dir = next(path / d for d in ("transformer", "transformer_2") if (path / d).is_dir())
            transformer = json.loads((transformer_dir / "config.json").read_text())
        except (OSError, ValueError, KeyError, StopIteration):
            return None
        if not str(name).startswith("Wan"):
            return None
        return cls._from_factors(name, vae.get("scale_factor_temporal", 4), vae.get("scale_factor_spatial", 8),
                                 transformer.get("patch_size", 1), transformer.get("rope_max_seq_len"))

    @classmethod
    def _from_factors(cls, name: str, temporal, spatial, patch, rope) -> "VideoRules":
        patch = patch or 1
        if isinstance(patch, (tuple, list)):
            patch = patch[-1]
        multiple = int(spatial) * int(patch)
        for prefix, minimum in _FAMILY_MIN_MULTIPLE.items():
            if name.startswith(prefix):
                multiple = math.lcm(multiple, minimum)
        max_size = max_frames = None
        if rope:
            max_size = int(rope) * int(spatial) * int(patch) // multiple * multiple
            max_frames = (int(rope) - 1) * int(temporal) + 1
        return cls(family=name, temporal_factor=int(temporal), spatial_multiple=multiple, max_size=max_size,
                   max_frames=max_frames)

    def check(self, *, num_frames: int, height: int, width: int, num_inference_steps: int,
              guidance_scale: float, prompt: str | list[str] | None) -> None:
        """Raise ``ValueError``/``TypeError`` naming the broken rule and how to fix it; return None if all valid."""
        for name, value in (("num_frames", num_frames), ("height", height), ("width", width),
                            ("num_inference_steps", num_inference_steps)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int; got {value!r}")
        self.check_sizes(num_frames=num_frames, height=height, width=width)
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1; got {num_inference_steps}")
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) \
                or not math.isfinite(guidance_scale) or guidance_scale < 0:
            raise ValueError(f"guidance_scale must be a finite number >= 0; got {guidance_scale!r}")
        check_prompts(prompt)

    def check_sizes(self, *, num_frames: int | None = None, height: int | None = None,
                    width: int | None = None) -> None:
        """The frame-count and size rules alone, for the values given (None: not checked).

        Raises:
            ValueError: naming the broken rule and the nearest valid values.
        """
        if num_frames is not None and (num_frames < 1 or (num_frames - 1) % self.temporal_factor):
            lower = max(1, (num_frames - 1) // self.temporal_factor * self.temporal_factor + 1)
            upper = lower + self.temporal_factor if num_frames > 1 else 1
            hint = f"{lower} or {upper}" if lower != upper else str(lower)
            raise ValueError(
                f"num_frames={num_frames} is not valid for {self.family}: it must be k*{self.temporal_factor}+1 "
                f"(1, {1 + self.temporal_factor}, {1 + 2 * self.temporal_factor}, ...); use {hint}"
            )
        if num_frames is not None and self.max_frames is not None and num_frames > self.max_frames:
            raise ValueError(f"num_frames={num_frames} exceeds {self.family}'s position table: at most "
                             f"{self.max_frames} frames")
        for name, value in (("height", height), ("width", width)):
            if value is None:
                continue
            if self.max_size is not None and value > self.max_size:
                raise ValueError(f"{name}={value} exceeds {self.family}'s position table: at most {self.max_size} "
                                 "pixels")
            if value < self.spatial_multiple or value % self.spatial_multiple:
                lower = max(self.spatial_multiple, value // self.spatial_multiple * self.spatial_multiple)
                raise ValueError(
                    f"{name}={value} is not valid for {self.family}: it must be a positive multiple of "
                    f"{self.spatial_multiple} (VAE compression x patch size); use {lower} or "
                    f"{lower + self.spatial_multiple}"
                )


def check_prompts(prompt: str | list[str] | None) -> None:
    """The rules on prompts that hold for every model (so callers can check them before loading one).

    Raises:
        ValueError: an empty or blank prompt, or one longer than :data:`MAX_PROMPT_CHARS` characters.
    """
    prompts = [prompt] if isinstance(prompt, str) or prompt is None else list(prompt)
    for p in prompts:
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"prompt must be a non-empty string; got {p!r}")
        if len(p) > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt is {len(p)} characters; the limit is {MAX_PROMPT_CHARS}")
