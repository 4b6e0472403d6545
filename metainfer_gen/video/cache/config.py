"""``StepCacheConfig``: the settings of the state-driven step cache ("auto" policy), validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# name -> (error_budget, max_consecutive_reuses): one knob from careful to fast.
PRESETS: dict[str, tuple[float, int]] = {
    "quality": (0.06, 2),
    "balanced": (0.12, 3),
    "fast": (0.25, 4),
}
DEFAULT_PRESET = "balanced"


@dataclass(slots=True)
class StepCacheConfig:
    """How the step cache decides, per denoising step and CFG branch, to reuse the transformer's residual.

    Every step runs the first transformer block. The relative L1 change of that block's residual against the
    previous step (the *signal*) is mapped to a predicted relative change of the full transformer residual by a
    ratio fitted online on the computed steps (no per-model coefficients). A step reuses the cached residual of
    the blocks after the first (optionally extrapolated to first order from the last two computed steps) while the
    predicted error accumulated over the current run of reused steps stays within ``error_budget``.

    Args:
        error_budget: the one quality/speed knob: accumulated predicted relative error (unitless, > 0) allowed
            before a step is recomputed. Larger reuses more (faster, lower fidelity). See :data:`PRESETS`.
        num_warmup_steps: computed steps per branch before any reuse (>= 1); at least two are needed to calibrate.
        max_consecutive_reuses: cap on reused steps in a row per branch (>= 1).
        compute_last_step: always compute the final step (needs the step count, which our pipelines pass).
        extrapolate: use first-order extrapolation of the residual from the last two computed steps, when its
            online-measured error is below that of plain reuse.
        calibration_momentum: weight of the previous ratio when a new one is measured, in [0, 1).
    Raises:
        ValueError: a value out of range, with what to use instead.
    Example::

        from metainfer_gen.video.cache import StepCacheConfig, apply_step_cache, remove_step_cache
        apply_step_cache(pipe.transformer, StepCacheConfig.preset("fast"))
        video = pipe("a red circle moving right", num_inference_steps=50).frames
        remove_step_cache(pipe.transformer)
    """

    error_budget: float = PRESETS[DEFAULT_PRESET][0]
    num_warmup_steps: int = 2
    max_consecutive_reuses: int = PRESETS[DEFAULT_PRESET][1]
    compute_last_step: bool = True
    extrapolate: bool = True
    calibration_momentum: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.error_budget, bool) or not isinstance(self.error_budget, (int, float)) \
                or not math.isfinite(self.error_budget) or self.error_budget <= 0:
            raise ValueError(f"error_budget must be a finite number > 0 (e.g. 0.12); got {self.error_budget!r}")
        for name in ("num_warmup_steps", "max_consecutive_reuses"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        for name in ("compute_last_step", "extrapolate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        momentum = self.calibration_momentum
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"calibration_momentum must be in [0, 1); got {momentum!r}")

    @classmethod
    def preset(cls, name: str = DEFAULT_PRESET, **overrides) -> "StepCacheConfig":
        """A named setting: ``"quality"``, ``"balanced"`` (what ``"auto"`` means) or ``"fast"``.

        Raises:
            ValueError: unknown name.
        """
        if name == "auto":
            name = DEFAULT_PRESET
        if name not in PRESETS:
            raise ValueError(f"unknown step-cache preset {name!r}; choose one of {sorted(PRESETS)} or 'auto'")
        budget, cap = PRESETS[name]
        return replace(cls(error_budget=budget, max_consecutive_reuses=cap), **overrides)

    def min_steps_for_reuse(self) -> int:
        """Fewest ``num_inference_steps`` that leave a step between the warm-up and the (computed) last step."""
        return self.num_warmup_steps + (2 if self.compute_last_step else 1)
