"""One switch for the video pipelines: ``pipe.enable_acceleration("fastest" | "balanced" | "quality")``.

It composes the per-feature switches in one order known to be correct (weights first, hooks outermost last; see
:mod:`metainfer_gen.video.presets`) and turns each on only where it is safe for the loaded model and this machine:
bf16 per component only with native bf16 (``platform.capabilities().bf16``) and where the component's own check
against float32 passes (:mod:`metainfer_gen.video.bf16_check`), the transformer on the CPU only from the width where
bf16 pays (:data:`CPU_BF16_MIN_WIDTH`); the model's step LoRA fused into the weights; the
fused kernels, the condition-embedder memo and the prompt-embedding cache wherever the model has the modules they
serve; regional compilation of the transformer blocks (diffusers' ``compile_repeated_blocks``) where it pays.
What is on, and why anything is refused, is the returned report, ``pipe.acceleration`` and every call's
``out.stats.extra["acceleration"]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STEP_LORA_ADAPTER = "steps"
# The embedded model's step LoRA (demo_models/video/train_step_lora.py): distilled for 4-8 unguided steps.
EMBEDDED_STEP_LORA = {"file": "steps_4_8.safetensors", "num_inference_steps": 4, "guidance_scale": 1.0}
PROBE_MAX_PIXELS, PROBE_MAX_FRAMES = 128, 17  # the bf16 checks' largest probe: 17 frames of 128x128
# Below this transformer width (attention heads x head size) bf16 does not pay on the CPU: its GEMMs are too small
# for AVX512-BF16 to win back the casts. Wan-style transformers, 2 blocks, 320 tokens, fused kernels, one thread
# (2026-12-02, AVX512-BF16): width 128 (the embedded model) 14.7 ms bf16 against 14.7 ms float32 (two threads
# 20.8 against 19.2 ms, 6 blocks), 256 1.31x faster in bf16, 512 1.44x, 1024 1.74x (1280 tokens at 512: 1.38x).
CPU_BF16_MIN_WIDTH = 256
# Why regional compilation stays off on the CPU (measured on the embedded model, unfused, 4 unguided steps):
CPU_COMPILE_REFUSAL = ("does not pay on the CPU at this model's size: on the embedded model (AVX512-BF16, 1 thread) "
                       "a 4-step clip took 1.57 s compiled against 1.58 s eager, after a 22-47 s first call; pass "
                       "compile_blocks=True to force it")


def step_lora_config(pipe, step_lora: Any = None) -> dict[str, Any] | None:
    """The step LoRA to fuse: ``{"file", "num_inference_steps", "guidance_scale"}``, or None when none is set.

    From ``step_lora`` (a file, or such a dict), else the model settings' ``"step_lora"`` entry (its ``file``
    relative to the model folder), else, for the embedded default model, its shipped ``steps_4_8`` LoRA.
    """
    from metainfer_gen.pipelines.loading import default_lora_dir, default_model_path

    if step_lora is not None:
        config = dict(step_lora) if isinstance(step_lora, dict) else {"file": str(step_lora)}
    elif isinstance(pipe.settings.get("step_lora"), dict):
        config = dict(pipe.settings["step_lora"])
        config["file"] = str(Path(str(pipe.source)) / config["file"])
    else:
        lora_dir = default_lora_dir()
        embedded = pipe.source is not None and Path(str(pipe.source)).resolve() == default_model_path().resolve()
        if not embedded or lora_dir is None or not (lora_dir / EMBEDDED_STEP_LORA["file"]).exists():
            return None
        config = {**EMBEDDED_STEP_LORA, "file": str(lora_dir / EMBEDDED_STEP_LORA["file"])}
    config.setdefault("num_inference_steps", EMBEDDED_STEP_LORA["num_inference_steps"])
    config.setdefault("guidance_scale", EMBEDDED_STEP_LORA["guidance_scale"])
    return config


class AccelerationMixin:
    """Methods of :class:`~metainfer_gen.pipelines.video_base.VideoPipelineBase`."""

    acceleration = None  # the AccelerationReport of enable_acceleration, or None

    def enable_acceleration(self, preset: str = "balanced", *, step_lora: Any = None,
                            compile_blocks: bool | None = None):
        """Turn on every acceleration of ``preset`` that is safe for this model and machine.

        Args:
            preset: ``"quality"`` (step cache ``quality``, float32), ``"balanced"`` (the cache ``quality=0.6``,
                the VAE in bf16 where its check passes) or ``"fastest"`` (``fast``, VAE and transformer in bf16 where
                their checks pass, and the model's step LoRA fused, rendering at its steps and guidance unless a call
                gives its own); see :mod:`metainfer_gen.video.presets`.
            step_lora: the step LoRA for ``fastest`` (file or ``{"file", "num_inference_steps",
                "guidance_scale"}``); default: the model's (``step_lora_config``).
            compile_blocks: force regional compilation on (True) or off (False); None: on where it pays (a GPU).
        Returns:
            The :class:`~metainfer_gen.video.presets.AccelerationReport` (also ``self.acceleration``).
        Raises:
            ValueError: an unknown preset, or a preset already enabled (load a fresh pipeline to change it: bf16
                weights and a fused LoRA are not undone).
        Example::

            pipe = pipelines.TextToVideoPipeline.from_pretrained()
            print(pipe.enable_acceleration("balanced").summary())
            out = pipe("a red circle moving right", seed=0)
        """
        from metainfer_gen.video.presets import AccelerationReport, get_preset

        chosen = get_preset(preset)
        if self.acceleration is not None:
            raise ValueError(f"the {self.acceleration.preset!r} preset is already enabled; load a fresh pipeline "
                             "(from_pretrained) for another one")
        report = AccelerationReport(chosen.name)
        with self._hooks_lifted():
            self._accelerate_step_lora(chosen, report, step_lora)
            self._accelerate_bf16(chosen, report)
        compiled = self._compile_decision(compile_blocks, report)
        self._accelerate_hooks(chosen, report, compiled)
        self.acceleration = report
        return report

    def _accelerate_step_lora(self, preset, report, step_lora: Any) -> None:
        if not preset.step_lora:
            report.refuse("step_lora", f"the {preset.name} preset keeps the model's own steps and guidance")
            return
        config = step_lora_config(self, step_lora)
        if config is None:
            report.refuse("step_lora", "no step LoRA is configured for this model (its settings have no "
                                       "'step_lora'); pass enable_acceleration(step_lora=FILE)")
        elif self.list_loras():
            report.refuse("step_lora", "other LoRAs are loaded; the step LoRA is fused only into the base weights")
        else:
            self.load_lora(config["file"], adapter_name=STEP_LORA_ADAPTER)
            self.fuse_lora()
            # The merged weights become the base: the adapter layers go (no per-call LoRA cost, and LoRAs a
            # request names later load on top of the stepped model as on any base).
            self.diffusers_pipeline.unload_lora_weights()
            self._loras = None
            report.call_defaults.update(num_inference_steps=int(config["num_inference_steps"]),
                                        guidance_scale=float(config["guidance_scale"]))
            report.on("step_lora", f"{Path(config['file']).name} fused into the weights; "
                                   f"{config['num_inference_steps']} steps, guidance {config['guidance_scale']}")

    def _accelerate_bf16(self, preset, report) -> None:
        from metainfer_gen.platform import capabilities
        from metainfer_gen.video import bf16_check

        caps = capabilities()
        # The probes run at the call's default size, capped (a check of seconds, not minutes, on a large model).
        height, width = min(self.default("height"), PROBE_MAX_PIXELS), min(self.default("width"), PROBE_MAX_PIXELS)
        frames = min(self.default("num_frames"), PROBE_MAX_FRAMES)
        pipe = self.diffusers_pipeline
        latent = ((frames - 1) // getattr(pipe, "vae_scale_factor_temporal", 4) + 1,
                  height // getattr(pipe, "vae_scale_factor_spatial", 8),
                  width // getattr(pipe, "vae_scale_factor_spatial", 8))
        parts = {"bf16_vae": ("vae", [getattr(pipe, "vae", None)]), "bf16_transformer": ("transformer",
                                                                                        self.transformers)}
        for feature, (component, modules) in parts.items():
            modules = [m for m in modules if m is not None]
            if component not in preset.bf16:
                report.refuse(feature, f"the {preset.name} preset keeps the {component} in float32")
            elif not caps.bf16 and not (self.device.startswith("cuda") and caps.has_gpu):
                report.refuse(feature, "this machine has no native bf16 (the CPU has neither amx_bf16 nor "
                                       "avx512_bf16): emulated bf16 is slower than float32")
            elif not modules:
                report.refuse(feature, f"the pipeline has no {component}")
            elif component == "transformer" and not self.device.startswith("cuda") and _narrow(modules):
                report.refuse(feature, f"does not pay on the CPU at this model's size: width {_narrow(modules)} "
                                       f"is below {CPU_BF16_MIN_WIDTH}, where bf16 GEMMs start to beat float32 "
                                       "(on the embedded model a forward took 20.8 ms in bf16 against 19.2 ms "
                                       "float32, two threads)")
            else:
                # all or none: a model's experts (Wan 2.2) must share one dtype
                backups = [bf16_check.float32_backup(m) for m in modules] if len(modules) > 1 else [None]
                decisions = [self._bf16_one(component, module, latent) for module in modules]
                refused = [d for d in decisions if not d.enabled]
                if refused:
                    for module, backup, decision in zip(modules, backups, decisions):
                        if decision.enabled and decision.db is not None:  # cast here: put float32 back
                            bf16_check.restore_float32(module, backup)
                    report.refuse(feature, refused[0].reason)
                else:
                    figures = ", ".join("bf16" if d.db is None else f"{d.db:.1f} dB" for d in decisions)
                    report.on(feature, f"bf16 ({figures} from float32; threshold {decisions[0].min_db:.0f} dB)")

    def _bf16_one(self, component: str, module, latent: tuple[int, int, int]):
        from metainfer_gen.video import bf16_check

        if component == "vae":
            return bf16_check.try_bf16("vae", module, bf16_check.vae_probe(module, *latent), bf16_check.VAE_MIN_DB,
                                       peak=1.0)
        patch = getattr(module.config, "patch_size", (1, 1, 1))
        shape = (latent[0], max(patch[1], latent[1] // patch[1] * patch[1]),
                 max(patch[2], latent[2] // patch[2] * patch[2]))
        length = int(self.settings.get("max_sequence_length", 16))
        return bf16_check.try_bf16("transformer", module, bf16_check.transformer_probe(module, *shape, length),
                                   bf16_check.TRANSFORMER_MIN_DB)

    def _compile_decision(self, compile_blocks: bool | None, report) -> bool:
        if compile_blocks is False:
            report.refuse("compile_blocks", "turned off by the caller (compile_blocks=False)")
            return False
        if compile_blocks is None and not self.device.startswith("cuda"):
            report.refuse("compile_blocks", CPU_COMPILE_REFUSAL)
            return False
        missing = [type(m).__name__ for m in self.transformers if not hasattr(m, "compile_repeated_blocks")]
        if missing:
            report.refuse("compile_blocks", f"{missing[0]} has no compile_repeated_blocks (no _repeated_blocks)")
            return False
        return True

    def _in_block_fusion_refusal(self) -> str | None:
        """Why the in-block fused ops (adaLN, q/k norm, rotary) stay off, or None.

        On the CPU their one faster-than-eager path is the compiled one, from ``COMPILED_MIN_NUMEL`` elements of
        hidden states; below it they run the eager reference behind the registry's dispatch, slower than the
        model's own code (embedded model, 320 tokens x 128, one thread: 30.3 ms per forward with them, 25.2 ms
        without, 28.2 ms unfused; the ops outside the blocks still pay).
        """
        from metainfer_gen.kernels.common import COMPILED_MIN_NUMEL

        if self.device.startswith("cuda"):
            return None
        pipe = self.diffusers_pipeline
        frames = (self.default("num_frames") - 1) // getattr(pipe, "vae_scale_factor_temporal", 4) + 1
        spatial = getattr(pipe, "vae_scale_factor_spatial", 8)
        numel = []
        for module in self.transformers:
            width = _width(module)
            if width is None:
                return None
            patch = getattr(getattr(module, "config", None), "patch_size", None) or (1, 1, 1)
            tokens = (frames // patch[0]) * (self.default("height") // spatial // patch[1]) * (
                self.default("width") // spatial // patch[2])
            numel.append(tokens * width)
        if not numel or max(numel) >= COMPILED_MIN_NUMEL:
            return None
        return (f"in-block ops would run their eager reference on the CPU at {max(numel)} elements per hidden state, "
                f"below the {COMPILED_MIN_NUMEL} where their compiled path pays: slower than the model's own")

    def _accelerate_hooks(self, preset, report, compiled: bool) -> None:
        from metainfer_gen.video.cache.embed_memo import embed_memo_refusal
        from metainfer_gen.video.fuse import FuseKernelsConfig
        from metainfer_gen.video.prompt_cache import apply_prompt_cache, get_prompt_cache, prompt_cache_refusal

        # Compiled blocks take the kernels outside the blocks only: the in-block kernels' per-module forwards
        # make dynamo recompile for every block (measured: the recompile limit at the 8th).
        eager = None if compiled else self._in_block_fusion_refusal()
        config = FuseKernelsConfig(adaln=False, qk_norm=False, rope=False) if compiled or eager else None
        try:
            self.enable_fused_kernels(config=config)
            report.on("fused_kernels", "outside the blocks (the blocks are compiled)" if compiled
                      else f"outside the blocks ({eager})" if eager else "all ops")
        except ValueError as error:
            report.refuse("fused_kernels", str(error))
        if compiled:
            for model in self.transformers:
                model.compile_repeated_blocks(fullgraph=False)
            report.on("compile_blocks", "torch.compile on each repeated transformer block")
        refusals = [embed_memo_refusal(m) for m in self.transformers]
        if all(refusals):
            report.refuse("embed_memo", refusals[0] or "no transformer")
        else:
            if not self.embed_memo_enabled:
                self.enable_embed_memo()
            report.on("embed_memo", "lossless, within each call")
        refusal = prompt_cache_refusal(self.diffusers_pipeline)
        if refusal:
            report.refuse("prompt_cache", refusal)
        else:
            cache = get_prompt_cache(self.diffusers_pipeline) or apply_prompt_cache(self.diffusers_pipeline)
            report.on("prompt_cache", f"LRU of {cache.max_entries} prompts, across calls")
        self._accelerate_cfg_batch(report)
        if self.step_cache is not None:
            report.on("step_cache", f"{self.step_cache.name} (enabled before the preset; kept)")
        else:
            self.enable_step_cache(preset.step_cache)
            report.on("step_cache", f"{preset.step_cache} (stands aside where too few steps are run; "
                                    "out.stats.cache says per call)")


    def _accelerate_cfg_batch(self, report) -> None:
        from metainfer_gen.video.cfg_parallel import PAIRED_CALL_PIPELINES

        name = type(self.diffusers_pipeline).__name__
        if self.cfg_parallel is not None:
            report.refuse("cfg_batch", "CFG-parallel is on: each rank computes one branch")
        elif name not in PAIRED_CALL_PIPELINES:
            report.refuse("cfg_batch", f"{name} is not known to call the transformer once per CFG branch")
        else:
            self.enable_cfg_batch()
            report.on("cfg_batch", "cond and uncond in one forward per guided step (equal within GEMM rounding)")


def _narrow(transformers) -> int | None:
    """The width (heads x head size) of the narrowest transformer when it is below :data:`CPU_BF16_MIN_WIDTH`;
    None when all are as wide or a width cannot be read from the config (then the quality check alone decides)."""
    widths = [_width(module) for module in transformers]
    if None in widths:
        return None
    narrowest = min(widths, default=None)
    return narrowest if narrowest is not None and narrowest < CPU_BF16_MIN_WIDTH else None


def _width(transformer) -> int | None:
    """Attention heads x head size from a diffusers transformer's config, or None where the config lacks them."""
    config = getattr(transformer, "config", None)
    heads, size = getattr(config, "num_attention_heads", None), getattr(config, "attention_head_dim", None)
    return heads * size if isinstance(heads, int) and isinstance(size, int) else None
