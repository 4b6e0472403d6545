"""Measure a step-cache calibration (:mod:`metainfer_gen.video.cache.calibration`) on one of our pipelines."""

from __future__ import annotations

import sys

from metainfer_gen.video.cache.apply import get_step_cache_stats
from metainfer_gen.video.cache.calibration import Calibration, fit
from metainfer_gen.video.cache.config import StepCacheConfig
from metainfer_gen.video.cache.policy import denoisers


def calibrate(pipe, prompts: list[str], num_inference_steps: int = 50, signal: str = "input",
              **call_kwargs) -> Calibration:
    """Measure a calibration with one uncached run per prompt of one of our pipelines (nothing is reused).

    Args:
        pipe: a :class:`~metainfer_gen.pipelines.TextToVideoPipeline` (or any of ours with no cache enabled).
        prompts: one or more prompts (two or three give a steadier mean; the curve barely depends on them).
        num_inference_steps: the step count to measure at; other counts interpolate over ``progress``.
        signal: ``"input"`` or ``"first_block"`` (must match the config that will use the file).
        call_kwargs: passed to every call (``num_frames``, ``height``, ``guidance_scale``, ``seed``...).
    Raises:
        ValueError: a cache is already enabled on ``pipe``, no prompt, or fewer than 3 steps.
    Example::

        cal = calibrate(pipe, ["a red circle moving right"], num_inference_steps=50)
        cal.save(beside_model(pipe.diffusers_pipeline))   # step_cache_calibration.json
    """
    if getattr(pipe, "step_cache", None) is not None:
        raise ValueError(f"disable the enabled step cache ({pipe.step_cache.name}) before calibrating")
    if not prompts:
        raise ValueError("calibrate needs at least one prompt")
    if num_inference_steps < 3:
        raise ValueError(f"calibrate needs num_inference_steps >= 3; got {num_inference_steps}")
    # A budget no predicted error fits in: every step is computed and measured (the cache stays on to record).
    recording = StepCacheConfig(error_budget=sys.float_info.min, num_warmup_steps=1, signal=signal)
    models = dict(denoisers(pipe.diffusers_pipeline))
    pipe.enable_step_cache(recording)
    stats = []
    try:
        for prompt in prompts:
            pipe(prompt, num_inference_steps=num_inference_steps, **call_kwargs)
            stats.append(get_step_cache_stats(next(iter(models.values()))))  # one tracker serves every expert
    finally:
        pipe.disable_step_cache()
    classes = {name: type(model).__name__ for name, model in models.items()}
    return fit(stats, signal, classes)
