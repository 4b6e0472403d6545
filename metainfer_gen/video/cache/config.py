"""``StepCacheConfig``: the settings of the state-driven step cache ("auto" policy), validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from metainfer_gen.video.cache.calibration import Calibration
from metainfer_gen.video.cache.signals import SIGNALS

# name -> (error_budget, max_consecutive_reuses): one knob from careful to fast, spaced about evenly in compute.
# Chosen on 6 training prompts of the embedded model (seeds 1000-1005, not the benchmark's held-out ones; 50 steps,
# guidance 4, the shipped calibration, step_size_exponent 1.5; mean PSNR against the uncached clip, T2V / I2V dB at
# T2V / I2V block evaluations of 600): (0.15, 3) 46.9 / 50.8 at 288 / 268, (0.25, 3) 45.7 / 48.8 at 240 / 224,
# (0.4, 3) 44.1 / 46.8 at 216 / 206 (quality), (0.6, 3) 40.2 / 44.2 at 194 / 192, (0.9, 4) 37.2 / 40.9 at 168
# (balanced), (1.3, 4) 35.3 / 38.5 at 168, (2.0, 6) 31.6 / 35.0 at 132, (3.0, 6) 30.0 / 33.6 at 132 (fast).
# Training prompts score lower than the held-out ones (docs/benchmarks_video.md#step-cache).
PRESETS: dict[str, tuple[float, int]] = {
    "quality": (0.4, 3),
    "balanced": (0.9, 4),
    "fast": (3.0, 6),
}
DEFAULT_PRESET = "balanced"
# Fewest num_inference_steps at which the named presets reuse at all (StepCacheConfig.min_inference_steps); below it
# a call computes every step. benchmarks/step_cache_few_steps.py on the embedded model (8 held-out prompts, the
# shipped calibration, guidance 4; PSNR mean / worst against the uncached clip of the same steps and seed; clips
# whose colour and direction stayed those of the uncached clip). T2V, 81 frames: auto at 4 steps 19.9 / 18.1 dB, 5
# of 8 kept; 6 steps 30.0 / 27.4 dB, 8 of 8, but 8 steps 28.3 / 21.4 dB, 6 of 8; from 10 steps on 29.4-33.9 /
# 24.9-29.8 dB, 8 of 8 (17 frames: 4 steps 2 of 8, 8 steps 6 of 8, 10-16 steps 8 of 8). fast reuses as auto up to 8
# steps, and from 10 on keeps what it keeps at 20 (25.8-28.9 / 22.9-25.8 dB, 6-8 of 8). I2V, 81 frames: quality's
# worst clip 12.8-16.1 dB at 4-8 steps, 20.6-24.6 dB from 10 on. One floor for all three.
PRESET_MIN_INFERENCE_STEPS = 10
# The same floor for unguided calls (guidance_scale <= 1, one branch per step: a reuse error is not multiplied by the
# guidance scale), e.g. the shipped step LoRA's 4-8 steps. benchmarks/step_cache_few_steps.py, 17 frames, 8 held-out
# prompts, auto with the floor off, PSNR mean / worst against the uncached clip of the same steps: the step LoRA
# T2V 4 steps 28.1 / 26.7 dB, 6 steps 33.9 / 31.8, 8 steps 36.2 / 31.1; I2V 29.7 / 27.2, 35.5 / 33.0, 36.6 / 33.4;
# the base model unguided (4 prompts, T2V) 33.7 / 31.9, 41.0 / 39.2, 40.7 / 34.4. Below 30 dB only at 4 steps.
PRESET_MIN_UNGUIDED_INFERENCE_STEPS = 6


@dataclass(slots=True)
class StepCacheConfig:
    """How the step cache decides, per denoising step and CFG branch, to reuse the transformer's residual.

    Every step measures a cheap *signal*: the relative L1 change, against the previous step, of the first block's
    inputs (image tokens plus timestep embedding, as TeaCache's modulated input; ``signal="input"``, nothing is
    computed on a reused step) or of the first block's residual (as FBCache; ``signal="first_block"``, the first
    block runs every step). A ratio maps it to the predicted relative change of the transformer residual: read from
    a calibration made by ``metainfer-gen calibrate`` (per position in the schedule, see
    :mod:`~metainfer_gen.video.cache.calibration`) when one is given, else fitted online on the computed steps.
    No per-model coefficients are fitted by hand. A step reuses the cached residual (optionally extrapolated to
    first order from the last two computed steps) while the predicted error accumulated over the current run of
    reused steps stays within ``error_budget``.

    Args:
        error_budget: the one quality/speed knob: accumulated predicted relative error (unitless, > 0) allowed
            before a step is recomputed. Larger reuses more (faster, lower fidelity). See :data:`PRESETS`.
        num_warmup_steps: computed steps per branch before any reuse (>= 1); at least two are needed to calibrate.
        warmup_fraction: share of ``num_inference_steps`` computed first when that is more (rounded; in [0, 1)):
            the first steps lay the clip out, and an error there is carried through the rest of the trajectory. On
            the embedded model at 50 steps, 4 warm-up steps instead of 2 kept 34.0 dB instead of 29.6 dB
            (``fast``, 3 prompts) for 2 more computed steps per branch.
        max_consecutive_reuses: cap on reused steps in a row per branch (>= 1), for a schedule of
            ``cap_reference_steps`` steps; other step counts scale it (see :meth:`reuse_cap`).
        cap_reference_steps: the schedule length the cap is stated for (>= 1), or None for a fixed cap. A run of
            reused steps is an extrapolation over a stretch of the trajectory; a fixed count covers 2.5x more of it
            at 20 steps than at 50. On the embedded model at 20 steps (8 held-out prompts, text-to-video, a
            calibration) the fixed cap of ``fast`` (6) kept 19.7 dB against the uncached clip and drew the wrong
            colour on half the clips; scaled to 3 it kept 29.5 dB and every colour.
        compute_last_step: always compute the final step (needs the step count, which our pipelines pass).
        extrapolate: on every reused step after two computed ones, add the first-order extrapolation of the
            residual from the last two computed steps (over the step index) instead of the last residual; the
            budget counts the smaller of the two predicted errors.
        gate_aware: on Wan-style blocks (adaLN-gated attention and feed-forward), keep the modules' outputs
            instead of the gated sum and rebuild the residual with the reused step's own gates
            (:mod:`~metainfer_gen.video.cache.gated`); other blocks keep the gated sum either way.
        step_size_exponent: each reused step's predicted error counts ``(mean step / this step) **
            step_size_exponent`` against the budget, the step sizes read from the timesteps the transformer gets
            (finite, >= 0; 0 counts every step alike). A shifted flow-matching schedule (Wan's shift 3-5) takes
            short steps early, where the clip is laid out and an error is carried through the whole rest of the
            trajectory, and long ones late. On the embedded model at 50 steps (6 training prompts, T2V / I2V, each
            exponent at the budget that gives 144 T2V blocks; I2V 132-144): 0 kept 28.3 / 32.8 dB, 1.0 30.7 /
            34.2, 1.5 30.8 / 36.1, 2.0 30.4 / 36.1 dB; weighting the late steps more instead (the signal times
            the step size) lost 1.0-1.3 dB against 0. See :data:`PRESETS` for the other budgets.
        calibration_momentum: weight of the previous ratio when a new one is measured, in [0, 1).
        signal: ``"input"`` (cheapest, default) or ``"first_block"`` (one block per reused step, more robust
            without a calibration).
        calibration: a :class:`~metainfer_gen.video.cache.calibration.Calibration` (its ``signal`` must match),
            or None to fit the ratio online.
        min_inference_steps: fewest ``num_inference_steps`` (>= 1) at which a call reuses at all, or None for no
            floor. A call with fewer computes every step, exactly as without the cache, and its stats'
            ``disabled_reason`` names the floor. A few-step schedule takes long steps, so one reused step skips a
            large stretch of the trajectory. The named presets set :data:`PRESET_MIN_INFERENCE_STEPS`; a config
            built directly has no floor unless given one (lower it, or pass None, to reuse below the presets'
            floor at your own risk: ``StepCacheConfig.preset("auto", min_inference_steps=4)``). Independent of it,
            a call shorter than :meth:`min_steps_for_reuse` has no step to reuse.
        min_unguided_inference_steps: the floor for calls without classifier-free guidance (one branch per step),
            or None to apply ``min_inference_steps`` to them too. The named presets set
            :data:`PRESET_MIN_UNGUIDED_INFERENCE_STEPS` (6): unguided few-step runs (the step LoRA at 6 and 8 steps)
            kept 31-37 dB against their uncached clip where guided ones lost the clip.
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
    warmup_fraction: float = 0.08
    max_consecutive_reuses: int = PRESETS[DEFAULT_PRESET][1]
    cap_reference_steps: int | None = 50
    compute_last_step: bool = True
    extrapolate: bool = True
    gate_aware: bool = True
    step_size_exponent: float = 1.5
    calibration_momentum: float = 0.5
    signal: str = "input"
    calibration: Any = None
    min_inference_steps: int | None = None
    min_unguided_inference_steps: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.error_budget, bool) or not isinstance(self.error_budget, (int, float)) \
                or not math.isfinite(self.error_budget) or self.error_budget <= 0:
            raise ValueError(f"error_budget must be a finite number > 0 (e.g. 0.12); got {self.error_budget!r}")
        for name in ("num_warmup_steps", "max_consecutive_reuses"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        reference = self.cap_reference_steps
        if reference is not None and (isinstance(reference, bool) or not isinstance(reference, int) or reference < 1):
            raise ValueError(f"cap_reference_steps must be an integer >= 1 or None (a fixed cap); got {reference!r}")
        for name in ("min_inference_steps", "min_unguided_inference_steps"):
            floor = getattr(self, name)
            if floor is not None and (isinstance(floor, bool) or not isinstance(floor, int) or floor < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None (no floor); got {floor!r}")
        for name in ("compute_last_step", "extrapolate", "gate_aware"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        fraction = self.warmup_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1) (e.g. 0.08); got {fraction!r}")
        exponent = self.step_size_exponent
        if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not math.isfinite(exponent) \
                or exponent < 0:
            raise ValueError(f"step_size_exponent must be a finite number >= 0 (e.g. 1.0; 0 weighs every step "
                             f"alike); got {exponent!r}")
        momentum = self.calibration_momentum
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"calibration_momentum must be in [0, 1); got {momentum!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {SIGNALS}; got {self.signal!r}")
        if self.calibration is not None:
            if not isinstance(self.calibration, Calibration):
                raise ValueError(f"calibration must be a Calibration (calibration.load(path)) or None; got "
                                 f"{type(self.calibration).__name__}")
            if self.calibration.signal != self.signal:
                raise ValueError(f"the calibration measured signal={self.calibration.signal!r} but this config uses "
                                 f"signal={self.signal!r}: recalibrate or set signal={self.calibration.signal!r}")

    @classmethod
    def preset(cls, name: str = DEFAULT_PRESET, **overrides) -> "StepCacheConfig":
        """A named setting: ``"quality"``, ``"balanced"`` (what ``"auto"`` means) or ``"fast"``, with its
        :data:`PRESETS` budget and cap and the :data:`PRESET_MIN_INFERENCE_STEPS` floor; ``overrides`` replace
        fields (``min_inference_steps=None`` lifts the floor).

        Raises:
            ValueError: unknown name.
        """
        if name == "auto":
            name = DEFAULT_PRESET
        if name not in PRESETS:
            raise ValueError(f"unknown step-cache preset {name!r}; choose one of {sorted(PRESETS)} or 'auto'")
        budget, cap = PRESETS[name]
        config = cls(error_budget=budget, max_consecutive_reuses=cap, min_inference_steps=PRESET_MIN_INFERENCE_STEPS,
                     min_unguided_inference_steps=PRESET_MIN_UNGUIDED_INFERENCE_STEPS)
        return replace(config, **overrides)

    def reuse_cap(self, num_inference_steps: int | None) -> int:
        """Most reused steps in a row per branch for a run of ``num_inference_steps`` (None: unknown, the cap as
        stated): ``ceil(max_consecutive_reuses * num_inference_steps / cap_reference_steps)``, at least 1, so a
        run of reuses spans the same share of the schedule at any step count."""
        if not num_inference_steps or self.cap_reference_steps is None:
            return self.max_consecutive_reuses
        return max(1, math.ceil(self.max_consecutive_reuses * num_inference_steps / self.cap_reference_steps))

    def warmup_steps(self, num_inference_steps: int | None) -> int:
        """Computed steps per branch before any reuse, for a run of ``num_inference_steps`` (None: unknown)."""
        if not num_inference_steps:
            return self.num_warmup_steps
        return max(self.num_warmup_steps, round(self.warmup_fraction * num_inference_steps))

    def min_steps_for_reuse(self) -> int:
        """Fewest ``num_inference_steps`` that leave a step between the warm-up and the (computed) last step."""
        return self.num_warmup_steps + (2 if self.compute_last_step else 1)

    def reuse_off_reason(self, num_inference_steps: int | None, guided: bool = True) -> str | None:
        """Why a call of ``num_inference_steps`` reuses no step at all, or None when it may (None steps: unknown).

        Too few steps for the warm-up and the computed last step (:meth:`min_steps_for_reuse`), or fewer than
        :attr:`min_inference_steps` (:attr:`min_unguided_inference_steps` for an unguided call, when set).
        """
        steps = num_inference_steps
        if steps is None:
            return None
        needed = self.min_steps_for_reuse()
        if steps < needed:
            return (f"num_inference_steps={steps} is below {needed}: warm-up ({self.num_warmup_steps}) and the "
                    "computed last step leave no step to reuse")
        if not guided and self.min_unguided_inference_steps is not None:
            if steps < self.min_unguided_inference_steps:
                return (f"num_inference_steps={steps} is below min_unguided_inference_steps="
                        f"{self.min_unguided_inference_steps}: at so few steps each reused step skips a long stretch "
                        "of the trajectory (the step LoRA at 4 unguided steps kept 28 dB against its uncached clip, "
                        "under 30 dB); set StepCacheConfig.min_unguided_inference_steps lower to reuse anyway")
            return None
        if self.min_inference_steps is not None and steps < self.min_inference_steps:
            return (f"num_inference_steps={steps} is below min_inference_steps={self.min_inference_steps}: at so "
                    "few steps each reused step skips a long stretch of the trajectory (on the embedded model "
                    f"guided reuse lost the clip below {PRESET_MIN_INFERENCE_STEPS} steps); set "
                    "StepCacheConfig.min_inference_steps lower to reuse anyway")
        return None
