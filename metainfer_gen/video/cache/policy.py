"""What a cache policy is: applied to a diffusers pipeline's transformer(s) once, wrapped around every call in
:meth:`CachePolicy.session` (step count in, stats out), removed completely. Ours (:class:`StepCachePolicy`) and the
diffusers hooks (:class:`DiffusersCachePolicy`); :mod:`.policies` builds them by name, :mod:`.baselines` holds the
public baselines.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from metainfer_gen.video.cache import calibration
from metainfer_gen.video.cache.config import StepCacheConfig


def denoisers(pipe) -> list[tuple[str, Any]]:
    """``[(attribute name, transformer), ...]`` of a diffusers pipeline: one, or two for Wan 2.2's experts."""
    names = ("transformer", "transformer_2")
    return [(n, getattr(pipe, n)) for n in names if getattr(pipe, n, None) is not None]


def call_info(pipe):
    """The running call's :class:`~metainfer_gen.video.cache.state.CallInfo`, read from a diffusers pipeline
    inside its denoising loop: whether it guides (``do_classifier_free_guidance``; True when the pipeline does not
    say), and for Wan 2.2's experts the steps each denoises, ``{"transformer": (0, n_high), "transformer_2":
    (n_high, n_low)}``, as diffusers' Wan pipelines switch (timestep >= ``boundary_ratio`` x
    ``num_train_timesteps`` on the high-noise ``transformer``, the rest on ``transformer_2``)."""
    from metainfer_gen.video.cache.state import CallInfo

    guided = bool(getattr(pipe, "do_classifier_free_guidance", True))
    ratio = dict(getattr(pipe, "config", {})).get("boundary_ratio")
    if ratio is None or getattr(pipe, "transformer_2", None) is None:
        return CallInfo(None, guided)
    timesteps = pipe.scheduler.timesteps
    high = int((timesteps >= ratio * pipe.scheduler.config.num_train_timesteps).sum())
    return CallInfo({"transformer": (0, high), "transformer_2": (high, len(timesteps) - high)}, guided)


class CachePolicy:
    """Base: ``apply`` once, ``session`` around every call, ``remove`` once. Subclasses set ``name``."""

    name = ""

    def apply(self, pipe) -> None:
        raise NotImplementedError

    def remove(self, pipe) -> None:
        raise NotImplementedError

    @contextmanager
    def session(self, pipe, num_inference_steps: int) -> Iterator[dict[str, Any]]:
        """Around one pipeline call; the yielded dict holds the call's cache stats afterwards."""
        report: dict[str, Any] = {"policy": self.name}
        try:
            yield report
        finally:
            for _, model in denoisers(pipe):  # no state may leak into the next call (shape/steps may change)
                from diffusers.hooks import HookRegistry

                HookRegistry.check_if_exists_or_initialize(model).reset_stateful_hooks()


class StepCachePolicy(CachePolicy):
    """Ours: :func:`~metainfer_gen.video.cache.apply.apply_step_cache` on each transformer, one shared tracker.

    With ``find_calibration`` (the named presets), a ``step_cache_calibration.json`` beside the model
    (``metainfer-gen calibrate``) supplies the signal-to-error ratios when the config has none and the file was
    measured on the same transformer classes; otherwise the ratios are fitted online. ``self.ratios`` says which.
    The file describes the base weights: while a LoRA is active the ratios are fitted online instead (the hooks
    are re-applied when the LoRA state changes).
    """

    def __init__(self, config: StepCacheConfig, name: str = "auto", find_calibration: bool = False):
        self.config, self.name, self.find_calibration = config, name, find_calibration
        self.ratios = "online"
        self.applied_for: tuple | None = None  # lora_state of the denoisers when the hooks were applied

    def apply(self, pipe) -> None:
        from metainfer_gen.video.cache.apply import apply_step_cache
        from metainfer_gen.video.cache.state import CallTracker

        from metainfer_gen.video.lora import lora_state

        config = self._with_calibration(pipe)
        self.applied_for = tuple(lora_state(model) for _, model in denoisers(pipe))
        tracker = CallTracker(policy=self.name)
        tracker.current.policy = self.name
        for attribute, model in denoisers(pipe):
            apply_step_cache(model, config, tracker=tracker, model_name=attribute)

    def _with_calibration(self, pipe) -> StepCacheConfig:
        from dataclasses import replace

        from metainfer_gen.video.lora import lora_active

        config = self.config
        if config.calibration is None and self.find_calibration:
            path = calibration.beside_model(pipe)
            if any(lora_active(model) for _, model in denoisers(pipe)):
                path = None  # measured on the base weights; a LoRA changes the curve (a step LoRA: entirely)
                self.ratios = "online (a LoRA is active: the stored calibration describes the base weights)"
            if path is not None and path.is_file():
                found = calibration.load(path)
                if found.matches(dict(denoisers(pipe))) is None:
                    config = replace(config, signal=found.signal, calibration=found)
        if config.calibration is not None:
            self.ratios = config.calibration.source or "given"
        elif not self.ratios.startswith("online ("):
            self.ratios = "online"
        return config

    def remove(self, pipe) -> None:
        from metainfer_gen.video.cache.apply import is_step_cache_enabled, remove_step_cache

        for _, model in denoisers(pipe):
            if is_step_cache_enabled(model):
                remove_step_cache(model)

    @contextmanager
    def session(self, pipe, num_inference_steps: int) -> Iterator[dict[str, Any]]:
        from metainfer_gen.video.cache.apply import begin_step_cache_call, end_step_cache_call

        from metainfer_gen.video.lora import lora_state

        scheduler = getattr(pipe, "scheduler", None)
        models = [model for _, model in denoisers(pipe)]
        adapters = tuple(lora_state(m) for m in models)
        if self.find_calibration and adapters != self.applied_for:
            self.remove(pipe)  # the LoRA state decides between the stored calibration and online ratios
            self.apply(pipe)
        # A new step count, scheduler or LoRA state (adapters, weights, fused) is a new plan: nothing carries over.
        plan = (num_inference_steps, type(scheduler).__name__,
                repr(sorted(dict(getattr(scheduler, "config", {})).items())), adapters)
        for model in models:
            begin_step_cache_call(model, num_inference_steps, plan, info_source=lambda: call_info(pipe))
        report: dict[str, Any] = {"policy": self.name}
        try:
            yield report
        finally:
            stats = [end_step_cache_call(model) for model in models]
            if stats and stats[0] is not None:
                stats[0].ratios = self.ratios
                report.update(stats[0].to_dict())


class DiffusersCachePolicy(CachePolicy):
    """A diffusers cache hook through ``transformer.enable_cache(config)`` / ``disable_cache()``.

    ``make_config(transformer, num_inference_steps)`` builds the config; when it depends on the step count
    (MagCache) the hooks are re-applied for a call with a different count.
    """

    def __init__(self, name: str, make_config: Callable[[Any, int | None], Any], per_steps: bool = False):
        self.name, self.make_config, self.per_steps = name, make_config, per_steps
        self.applied_steps: int | None = None

    def apply(self, pipe, num_inference_steps: int | None = None) -> None:
        for _, model in denoisers(pipe):
            if not hasattr(model, "enable_cache"):
                raise ValueError(f"{type(model).__name__} has no diffusers enable_cache(): cannot run {self.name}")
            model.enable_cache(self.make_config(model, num_inference_steps))
        self.applied_steps = num_inference_steps

    def remove(self, pipe) -> None:
        for _, model in denoisers(pipe):
            if getattr(model, "is_cache_enabled", False):
                model.disable_cache()

    @contextmanager
    def session(self, pipe, num_inference_steps: int) -> Iterator[dict[str, Any]]:
        if self.per_steps and num_inference_steps != self.applied_steps:
            self.remove(pipe)
            self.apply(pipe, num_inference_steps)
        with super().session(pipe, num_inference_steps) as report:
            yield report
