"""Shared machinery of the user-facing video pipelines: loading, defaults, validation, seeding and stats.

The objects wrap a diffusers pipeline (composition: ``pipe.diffusers_pipeline``) and add what users asked for:
input errors before any work, a seed argument, uint8 frames, per-call stats and a ``save`` that writes
browser-playable MP4; they also speak diffusers (``output_type``, ``num_videos_per_prompt``, ``.to()``,
``.components``, the component attributes, CPU offload). Accelerators attach to the wrapped model from outside:
the lossless embed memo is on from ``from_pretrained`` (as in the CLI); the step cache, LoRA and fused kernels are
off until enabled, or all on together with :meth:`enable_acceleration` (a preset).
"""

from __future__ import annotations

import inspect
from typing import Any

from metainfer_gen.pipelines.acceleration import AccelerationMixin
from metainfer_gen.pipelines.diffusers_compat import DiffusersCompatMixin
from metainfer_gen.pipelines.kernel_accelerators import KernelAcceleratorsMixin
from metainfer_gen.pipelines.loading import load_diffusers_pipeline
from metainfer_gen.pipelines.parallel import ParallelMixin
from metainfer_gen.pipelines.video_calls import VideoCallMixin
from metainfer_gen.video.rules import VideoRules

# Call arguments with a default from the model's settings file or, failing that, from the diffusers signature.
_SHAPE_ARGS = ("num_frames", "height", "width", "num_inference_steps", "guidance_scale")


class VideoPipelineBase(DiffusersCompatMixin, VideoCallMixin, AccelerationMixin, KernelAcceleratorsMixin,
                        ParallelMixin):
    """Base of :class:`TextToVideoPipeline` and :class:`ImageToVideoPipeline`; not used directly."""

    task: str = ""

    def __init__(self, pipe, settings: dict[str, Any] | None = None, source: Any = None):
        self.diffusers_pipeline = pipe
        self.settings = dict(settings or {})
        self.source = source
        self.rules = VideoRules.from_pipeline(pipe)
        self.last_audit = None  # kernels.Audit of the last call: which kernel paths ran, and why others were refused
        self.step_cache = None  # the enabled video.cache.CachePolicy, or None
        self.cfg_parallel = self.context_parallel = None  # one clip on several ranks (pipelines.parallel)
        self._loras = None  # video.lora.LoraSet, made on first use
        self.acceleration = None  # video.presets.AccelerationReport of enable_acceleration, or None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path=None, *, torch_dtype=None, device: str | None = None,
                        vae_dtype=None, embed_memo: bool = True, **kwargs):
        """Load the embedded default model (no argument), a local pipeline folder or a hub id.

        Args:
            pretrained_model_name_or_path: None, a directory saved by ``save_pretrained``, or a hub id.
            torch_dtype: weights dtype; default float32 on CPU, bfloat16 on CUDA; or diffusers' dict per component.
            device: where to run; default CUDA when available, else CPU.
            vae_dtype: the VAE's own dtype, e.g. ``torch.bfloat16`` for a decode about 1.5x faster on a CPU with native
                bf16 (see ``pipelines.loading.load_diffusers_pipeline``); default: ``torch_dtype``.
            embed_memo: reuse the condition embedder's exact outputs within each call (lossless, bit-identical
                clips; :meth:`enable_embed_memo`); on by default where the model has Wan's condition embedder,
                skipped without a word elsewhere.
            kwargs: forwarded to ``diffusers.DiffusionPipeline.from_pretrained`` (e.g. ``variant``).
        Raises:
            FileNotFoundError: a local path that does not exist or holds no pipeline.
            ValueError: the checkpoint cannot perform this pipeline's task.
        """
        pipe, source, settings = load_diffusers_pipeline(
            pretrained_model_name_or_path, cls.task, torch_dtype=torch_dtype, device=device, vae_dtype=vae_dtype,
            **kwargs
        )
        new = cls(pipe, settings=settings, source=source)
        if embed_memo:
            from metainfer_gen.video.cache.embed_memo import embed_memo_refusal

            if any(embed_memo_refusal(model) is None for model in new.transformers):
                new.enable_embed_memo()
        return new

    @classmethod
    def from_pipe(cls, other: "VideoPipelineBase"):
        """This task on the already-loaded weights of ``other`` (no reload), where the checkpoint allows it.

        Raises:
            ValueError: the checkpoint cannot perform this task.
        """
        from metainfer_gen.pipelines.loading import for_task

        pipe = for_task(other.diffusers_pipeline, cls.task)
        progress = getattr(other.diffusers_pipeline, "_progress_bar_config", None)
        if progress and pipe is not other.diffusers_pipeline:
            pipe.set_progress_bar_config(**progress)
        new = cls(pipe, settings=other.settings, source=other.source)
        new.step_cache = other.step_cache  # same transformer objects: the hooks are already on them
        new.cfg_parallel, new.context_parallel = other.cfg_parallel, other.context_parallel
        new.cfg_batch = other.cfg_batch
        new._loras = other._loras  # and the same adapters
        new.acceleration = other.acceleration  # the preset's weights and hooks are on the shared modules
        if pipe is not other.diffusers_pipeline:
            from metainfer_gen.video.prompt_cache import share_prompt_cache

            share_prompt_cache(other.diffusers_pipeline, pipe)
        return new

    @property
    def device(self) -> str:
        return str(self.diffusers_pipeline.device)

    @property
    def transformers(self) -> list:
        """The denoising model(s): one, or two for Wan 2.2's high/low-noise experts."""
        pipe = self.diffusers_pipeline
        return [m for m in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None)) if m is not None]

    def default(self, name: str) -> Any:
        """Default of call argument ``name``: the acceleration preset's (a fused step LoRA's steps and guidance),
        then the model's settings file, then the diffusers signature."""
        if self.acceleration is not None and name in self.acceleration.call_defaults:
            return self.acceleration.call_defaults[name]
        if name in self.settings:
            return self.settings[name]
        parameter = inspect.signature(self.diffusers_pipeline.__call__).parameters.get(name)
        return None if parameter is None else parameter.default

    def resolve(self, **given: Any) -> dict[str, Any]:
        """Fill unset shape/step arguments with defaults and validate everything before any work.

        Warns (``UserWarning``) when a call overrides the steps or guidance a fused step LoRA was distilled for:
        the call runs as asked, but such a LoRA at many guided steps degrades the clip (pass neither argument to
        run at the preset's own, or use a preset without the step LoRA for the model's settings).
        """
        values = {name: given.get(name) if given.get(name) is not None else self.default(name) for name in _SHAPE_ARGS}
        self.rules.check(prompt=given.get("prompt"), **values)
        distilled = self.acceleration.call_defaults if self.acceleration is not None else {}
        overridden = {k: values[k] for k, v in distilled.items() if values.get(k) is not None and values[k] != v}
        if overridden:
            import warnings

            asked = ", ".join(f"{k}={v}" for k, v in overridden.items())
            warnings.warn(f"the {self.acceleration.preset!r} preset fused a step LoRA distilled for "
                          f"{', '.join(f'{k}={v}' for k, v in distilled.items())}; this call asks {asked}, outside "
                          f"what it was distilled for, so expect a degraded clip: omit those arguments to run at "
                          f"the preset's own, or use the 'balanced' preset for the model's settings",
                          UserWarning, stacklevel=3)
        return values

    def enable_step_cache(self, cache: Any = "auto", calibration: Any = None) -> None:
        """Reuse transformer work across denoising steps.

        Args:
            cache: ``"auto"`` (ours, balanced), ``"quality"`` / ``"fast"`` (ours, careful / aggressive),
                ``"auto=0.2"`` (ours with that error budget), a ``video.cache.StepCacheConfig``, or a baseline for
                comparison: ``"fbcache[=threshold]"``, ``"magcache[=threshold]"``, ``"taylorseer[=interval]"``,
                ``"dbcache[=threshold]"`` (needs cache-dit). ``"off"`` does nothing. The named presets stand
                aside in guided calls of fewer than ``video.cache.config.PRESET_MIN_INFERENCE_STEPS`` (10) steps
                and unguided ones of fewer than ``PRESET_MIN_UNGUIDED_INFERENCE_STEPS`` (6), where reuse lost the
                clip (stats: ``disabled_reason``); a ``StepCacheConfig`` sets its own floors (default: none).
            calibration: for ours, a ``metainfer-gen calibrate`` file (path) or a loaded ``Calibration``. Left
                out, the named presets (``"auto"``, ``"quality"``, ``"fast"``, ``"auto=0.2"``) use the
                ``step_cache_calibration.json`` beside the model when present; a ``StepCacheConfig`` uses its own
                ``calibration`` field and does not look for the file (pass it here to use it). Without either the
                signal-to-error ratios are fitted online.
        Raises:
            ValueError: a cache is already enabled (call :meth:`disable_step_cache` first), a bad spec, or a
                calibration given with a baseline. FileNotFoundError: no such calibration file.
        Each call's ``out.stats.cache`` then reports what the cache did; ``out.stats.block_evaluations`` counts
        the blocks that ran.
        """
        from metainfer_gen.video.cache import make_policy

        if self.step_cache is not None:
            raise ValueError(f"a step cache ({self.step_cache.name}) is already enabled; call disable_step_cache() "
                             "first")
        policy = make_policy(cache, calibration=calibration)
        if policy is not None:
            policy.apply(self.diffusers_pipeline)
        self.step_cache = policy

    def disable_step_cache(self) -> None:
        """Remove the step cache; calls then compute exactly as without it. No-op when none is enabled."""
        if self.step_cache is not None:
            self.step_cache.remove(self.diffusers_pipeline)
        self.step_cache = None

    @property
    def loras(self):
        """The :class:`~metainfer_gen.video.lora.LoraSet` of this pipeline (adapters, weights, reports)."""
        if self._loras is None:
            from metainfer_gen.video.lora import LoraSet

            self._loras = LoraSet(self.diffusers_pipeline)
        return self._loras

    def load_lora(self, path_or_state_dict, adapter_name: str | None = None, weight: float = 1.0):
        """Load a LoRA (diffusers, peft, original-Wan, kohya or mixed keys) as an active adapter.

        Keys that match nothing are skipped and listed in the returned report (also logged). Example::

            report = pipe.load_lora("style.safetensors", adapter_name="style", weight=0.8)
            print(report.summary())
        Returns:
            A :class:`~metainfer_gen.video.lora.LoraReport`.
        Raises:
            ValueError: NaN/Inf values, no key matching the model, a duplicate name, or fused adapters (the
                model is left unchanged). FileNotFoundError: no such file.
        """
        return self.loras.load(path_or_state_dict, adapter_name=adapter_name, weight=weight)

    def set_lora_weights(self, weights: dict[str, float]) -> None:
        """``{adapter name: weight}`` for the next calls (no reload). Raises ValueError for unknown names."""
        self.loras.set_weights(weights)

    def disable_lora(self) -> None:
        """Render with the base model; adapters stay loaded."""
        self.loras.disable()

    def enable_lora(self) -> None:
        """Render with the adapters again after :meth:`disable_lora`."""
        self.loras.enable()

    def fuse_lora(self) -> None:
        """Merge the active adapters into the weights (faster calls); :meth:`unfuse_lora` restores the base
        exactly. Weights cannot change while fused."""
        self.loras.fuse()

    def unfuse_lora(self) -> None:
        """Undo :meth:`fuse_lora`, bit for bit."""
        self.loras.unfuse()

    def unload_lora(self, adapter_name: str | None = None) -> None:
        """Remove one adapter, or all of them when no name is given."""
        self.loras.unload(adapter_name)

    def list_loras(self) -> list[dict[str, Any]]:
        """Loaded adapters: name, weight, source, modules, skipped keys, enabled, fused."""
        return [] if self._loras is None else self._loras.info()

    def set_progress_bar_config(self, **kwargs) -> None:
        """Forwarded to diffusers (e.g. ``disable=True`` to silence the per-step bar)."""
        self.diffusers_pipeline.set_progress_bar_config(**kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.diffusers_pipeline).__name__} from {self.source}, {self.rules})"
