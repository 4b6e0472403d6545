"""The rows of ``video_throughput.py``: plain diffusers, ours with each acceleration added in turn, each preset.

Every row is one loaded pipeline and ``render(item, seed) -> (uint8 frames, seconds by piece)``; the benchmark
times the call and the export around it. Rows run the same instrumentation (``video.pieces.time_pieces``: forward
hooks on the text encoder and transformer, the VAE's encode and decode timed), plain diffusers' row included.
"""

from __future__ import annotations

from typing import Any

# Ours, each acceleration added in turn (cumulative), then each preset. Names are the --rows keys.
STEPS = ("ours", "+fused", "+memo", "+prompt_cache", "+bf16_vae", "+cfg_batch", "+cache_auto", "+step_lora")
PRESET_ROWS = ("preset_quality", "preset_balanced", "preset_fastest")
ROWS = ("diffusers", *STEPS, *PRESET_ROWS)
BASELINE = "diffusers"


def _plain_diffusers(model: str | None, task: str):
    """diffusers' own pipeline on the same weights: ``WanPipeline`` or ``WanImageToVideoPipeline`` (the embedded
    model's weights serve both; the I2V one is built from its components, as diffusers' docs do), float32."""
    import torch
    from diffusers import DiffusionPipeline

    from metainfer_gen.pipelines.loading import default_model_path, for_task

    pipe = DiffusionPipeline.from_pretrained(str(model or default_model_path()), dtype=torch.float32)
    pipe = for_task(pipe, task)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ours(model: str | None, task: str, row: str):
    """Our pipeline for ``row``: the accelerations of :data:`STEPS` up to it, or a preset. Returns (pipeline, note,
    call overrides)."""
    from metainfer_gen import pipelines
    from metainfer_gen.pipelines.acceleration import step_lora_config
    from metainfer_gen.pipelines.loading import TEXT_TO_VIDEO

    cls = pipelines.TextToVideoPipeline if task == TEXT_TO_VIDEO else pipelines.ImageToVideoPipeline
    pipe = cls.from_pretrained(model, device="cpu", embed_memo=False)
    pipe.set_progress_bar_config(disable=True)
    if row in PRESET_ROWS:
        report = pipe.enable_acceleration(row.removeprefix("preset_"))
        return pipe, report.summary(), {}
    notes, overrides = [], {}
    for step in STEPS[1:STEPS.index(row) + 1]:
        if step == "+fused":
            pipe.enable_fused_kernels()
        elif step == "+memo":
            pipe.enable_embed_memo()
        elif step == "+prompt_cache":
            from metainfer_gen.video.prompt_cache import apply_prompt_cache

            apply_prompt_cache(pipe.diffusers_pipeline)
        elif step == "+bf16_vae":
            notes.append(_bf16_vae(pipe))
        elif step == "+cfg_batch":
            pipe.enable_cfg_batch()
        elif step == "+cache_auto":
            pipe.enable_step_cache("auto")
        elif step == "+step_lora":
            config = step_lora_config(pipe)
            if config is None:
                return None, "no step LoRA configured for this model", {}
            pipe.load_lora(config["file"], adapter_name="steps")
            pipe.fuse_lora()
            overrides = {"num_inference_steps": config["num_inference_steps"],
                         "guidance_scale": config["guidance_scale"]}
            notes.append(f"step LoRA fused, {overrides}")
    return pipe, "; ".join(notes), overrides


def _bf16_vae(pipe) -> str:
    """The VAE in bf16 where the machine has native bf16 and its check passes (as the presets decide)."""
    from metainfer_gen.platform import capabilities
    from metainfer_gen.video import bf16_check

    if not capabilities().bf16:
        return "bf16 VAE refused: no native bf16"
    vae = pipe.diffusers_pipeline.vae
    latent = ((pipe.default("num_frames") - 1) // 4 + 1, pipe.default("height") // 8, pipe.default("width") // 8)
    with pipe._hooks_lifted():
        decision = bf16_check.try_bf16("vae", vae, bf16_check.vae_probe(vae, *latent), bf16_check.VAE_MIN_DB, 1.0)
    return f"bf16 VAE {'on' if decision.enabled else 'refused'} ({decision.db:.1f} dB)"


def make_row(row: str, model: str | None, task: str, call: dict[str, Any], preset_call: dict[str, Any]):
    """``(render, note)`` for ``row``, or ``(None, why)`` when the model cannot run it.

    Args:
        call: the call arguments of every non-preset row (the model's own steps and guidance, sizes).
        preset_call: those of the preset rows (sizes, and steps/guidance only when the run fixed them).
    """
    import time

    import torch

    from metainfer_gen.pipelines.loading import IMAGE_TO_VIDEO
    from metainfer_gen.video.output import to_uint8_frames
    from metainfer_gen.video.pieces import time_pieces, with_setup

    image_task = task == IMAGE_TO_VIDEO
    if row == BASELINE:
        pipe = _plain_diffusers(model, task)

        def render_plain(item, seed: int):
            kwargs = {"image": item[3]} if image_task else {}
            start = time.perf_counter()
            with time_pieces(pipe, [pipe.transformer], "cpu") as pieces:
                frames = pipe(prompt=item[0], generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
                              **call, **kwargs).frames[0]
            return to_uint8_frames(frames), with_setup(pieces, time.perf_counter() - start)
        return render_plain, "diffusers float32, its own kernels"
    pipe, note, overrides = _ours(model, task, row)
    if pipe is None:
        return None, note
    arguments = {**(preset_call if row in PRESET_ROWS else call), **overrides}
    arguments.pop("max_sequence_length", None)  # ours takes it from the model's settings

    def render_ours(item, seed: int):
        args = (item[3], item[0]) if image_task else (item[0],)
        out = pipe(*args, seed=seed, **arguments)
        return out.frames, dict(out.stats.extra["seconds_by_piece"])
    return render_ours, note

