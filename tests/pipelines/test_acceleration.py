"""``enable_acceleration``: every preset renders the same clip twice with the same seed, never turns on a path
that is refused on this model or machine, says why, and reports each call's pieces."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from metainfer_gen import pipelines
from metainfer_gen.platform import Capabilities, DeviceKind, override_capabilities
from metainfer_gen.video.presets import FEATURES, PRESETS

CALL = dict(num_frames=5, height=32, width=32, num_inference_steps=3, guidance_scale=3.0)
PROMPT = "a red circle moving right"
NO_BF16 = Capabilities(device_kind=DeviceKind.CPU, bf16=False)


def _pipe(model_dir, cls=pipelines.TextToVideoPipeline):
    pipe = cls.from_pretrained(model_dir, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _dtypes(module) -> set:
    return {p.dtype for p in module.parameters()}


def _check_report_matches_the_pipeline(pipe, report) -> None:
    """Each feature the report calls on is in effect, each refused one is not."""
    from metainfer_gen.video.fuse.core import is_fused
    from metainfer_gen.video.prompt_cache import get_prompt_cache

    assert set(report.enabled) | set(report.refused) == set(FEATURES)
    assert not set(report.enabled) & set(report.refused)
    assert all(report.refused.values())  # every refusal says why
    d = pipe.diffusers_pipeline
    state = {"fused_kernels": is_fused(d.transformer), "embed_memo": pipe.embed_memo_enabled,
             "prompt_cache": get_prompt_cache(d) is not None, "step_cache": pipe.step_cache is not None,
             "cfg_batch": pipe.cfg_batch,
             "bf16_vae": torch.bfloat16 in _dtypes(d.vae), "bf16_transformer": torch.bfloat16 in _dtypes(d.transformer),
             "step_lora": bool(report.call_defaults) and not pipe.list_loras(), "compile_blocks": any(
                 getattr(b, "_compiled_call_impl", None) is not None for b in d.transformer.blocks)}
    for feature, on in state.items():
        assert on == report.is_on(feature), (feature, report.summary())


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_renders_the_same_clip_twice_and_matches_its_report(tiny_wan_dir, preset):
    pipe = _pipe(tiny_wan_dir)
    report = pipe.enable_acceleration(preset)
    _check_report_matches_the_pipeline(pipe, report)
    first = pipe(PROMPT, seed=4, **CALL)
    second = pipe(PROMPT, seed=4, **CALL)
    np.testing.assert_array_equal(first.frames, second.frames)
    assert first.stats.extra["acceleration"]["preset"] == preset
    assert second.stats.extra["prompt_cache"]["num_hits"] >= 2  # prompt and negative prompt, from the first call
    pieces = second.stats.extra["seconds_by_piece"]
    assert set(pieces) == {"text_encoder", "transformer", "vae_encode", "vae_decode", "setup"}
    assert pieces["text_encoder"] == 0.0 and pieces["transformer"] > 0 and pieces["vae_decode"] > 0
    assert sum(pieces.values()) == pytest.approx(second.stats.seconds, rel=1e-6)


def test_image_to_video_from_pipe_shares_the_preset_and_is_deterministic(tiny_wan_dir):
    t2v = _pipe(tiny_wan_dir)
    t2v.enable_acceleration("balanced")
    i2v = pipelines.ImageToVideoPipeline.from_pipe(t2v)
    image = t2v(PROMPT, seed=0, **CALL).frames[0]
    first, second = (i2v(image, PROMPT, seed=1, **CALL) for _ in range(2))
    np.testing.assert_array_equal(first.frames, second.frames)
    assert first.stats.extra["acceleration"]["preset"] == "balanced"
    assert second.stats.extra["prompt_cache"]["num_hits"] >= 4  # shared with the text-to-video pipeline
    assert first.stats.extra["seconds_by_piece"]["vae_encode"] > 0  # the reference image's encode


def test_without_native_bf16_no_preset_casts_anything_and_says_why(tiny_wan_dir):
    pipe = _pipe(tiny_wan_dir)
    with override_capabilities(NO_BF16):
        report = pipe.enable_acceleration("fastest")
    _check_report_matches_the_pipeline(pipe, report)
    for feature in ("bf16_vae", "bf16_transformer"):
        assert "no native bf16" in report.refused[feature]
    assert {torch.float32} == _dtypes(pipe.diffusers_pipeline.vae) == _dtypes(pipe.diffusers_pipeline.transformer)
    assert "compile" in report.refused["compile_blocks"] or "CPU" in report.refused["compile_blocks"]
    assert "no step LoRA" in report.refused["step_lora"]  # the tiny model configures none
    assert pipe(PROMPT, seed=0, **CALL).frames.shape == (5, 32, 32, 3)


def test_a_failing_bf16_check_keeps_float32_bit_for_bit(tiny_wan_dir, monkeypatch):
    from metainfer_gen.pipelines import acceleration
    from metainfer_gen.video import bf16_check

    monkeypatch.setattr(acceleration, "CPU_BF16_MIN_WIDTH", 0)  # the tiny model is narrower: reach the check
    pipe = _pipe(tiny_wan_dir)
    before = {k: v.clone() for k, v in pipe.diffusers_pipeline.transformer.state_dict().items()}
    monkeypatch.setattr(bf16_check, "TRANSFORMER_MIN_DB", 1000.0)
    monkeypatch.setattr(bf16_check, "VAE_MIN_DB", 1000.0)
    with override_capabilities(Capabilities(device_kind=DeviceKind.CPU, bf16=True)):
        report = pipe.enable_acceleration("fastest")
    assert "below 1000 dB" in report.refused["bf16_transformer"] and "below 1000 dB" in report.refused["bf16_vae"]
    after = pipe.diffusers_pipeline.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == before[k].dtype for k in before)


def test_a_narrow_transformer_stays_float32_on_the_cpu_and_says_why(tiny_wan_dir):
    from metainfer_gen.pipelines.acceleration import CPU_BF16_MIN_WIDTH

    pipe = _pipe(tiny_wan_dir)
    config = pipe.diffusers_pipeline.transformer.config
    assert config.num_attention_heads * config.attention_head_dim < CPU_BF16_MIN_WIDTH
    with override_capabilities(Capabilities(device_kind=DeviceKind.CPU, bf16=True)):
        report = pipe.enable_acceleration("fastest")
    _check_report_matches_the_pipeline(pipe, report)
    assert "does not pay on the CPU" in report.refused["bf16_transformer"]
    assert _dtypes(pipe.diffusers_pipeline.transformer) == {torch.float32}


def test_bf16_keeps_the_modules_diffusers_keeps_in_float32(tiny_wan_dir, monkeypatch):
    from metainfer_gen.pipelines import acceleration

    monkeypatch.setattr(acceleration, "CPU_BF16_MIN_WIDTH", 0)
    pipe = _pipe(tiny_wan_dir)
    with override_capabilities(Capabilities(device_kind=DeviceKind.CPU, bf16=True)):
        report = pipe.enable_acceleration("fastest")
    transformer = pipe.diffusers_pipeline.transformer
    assert report.is_on("bf16_transformer")
    assert transformer.blocks[0].ffn.net[0].proj.weight.dtype == torch.bfloat16
    assert transformer.scale_shift_table.dtype == torch.float32  # in Wan's _keep_in_fp32_modules
    assert pipe(PROMPT, seed=0, **CALL).frames.dtype == np.uint8


def test_presets_refuse_a_second_enable_and_unknown_names(tiny_wan_dir):
    pipe = _pipe(tiny_wan_dir)
    with pytest.raises(ValueError, match="unknown acceleration preset 'warp'"):
        pipe.enable_acceleration("warp")
    pipe.enable_acceleration("quality")
    with pytest.raises(ValueError, match="already enabled"):
        pipe.enable_acceleration("fastest")


def test_fastest_on_the_embedded_model_fuses_its_step_lora_and_renders_at_its_steps():
    pipe = pipelines.TextToVideoPipeline.from_pretrained(device="cpu")
    pipe.set_progress_bar_config(disable=True)
    report = pipe.enable_acceleration("fastest", compile_blocks=False)
    _check_report_matches_the_pipeline(pipe, report)
    assert report.call_defaults == {"num_inference_steps": 4, "guidance_scale": 1.0}
    assert "turned off by the caller" in report.refused["compile_blocks"]
    base = pipelines.TextToVideoPipeline.from_pretrained(device="cpu").diffusers_pipeline.transformer
    fused = pipe.diffusers_pipeline.transformer
    assert not torch.equal(base.blocks[0].attn1.to_k.weight, fused.blocks[0].attn1.to_k.weight.float())
    assert "lora" not in " ".join(name for name, _ in fused.named_modules())  # merged, no adapter layers left
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the preset's own settings: no warning
        first, second = (pipe(PROMPT, seed=2) for _ in range(2))
    np.testing.assert_array_equal(first.frames, second.frames)
    assert first.settings["num_inference_steps"] == 4 and first.stats.transformer_calls == 4  # unguided
    with pytest.warns(UserWarning, match=r"distilled for num_inference_steps=4, guidance_scale=1.0; this call "
                                         r"asks num_inference_steps=6, outside"):
        out = pipe(PROMPT, seed=2, num_inference_steps=6)
    assert out.stats.transformer_calls == 6  # a call's own value wins, said out loud


def test_forced_regional_compilation_compiles_each_block_and_keeps_the_clip(tiny_wan_dir):
    """The GPU path, forced on the CPU (slow: one inductor compile of the tiny model's blocks)."""
    reference = _pipe(tiny_wan_dir)(PROMPT, seed=0, **CALL).frames
    pipe = _pipe(tiny_wan_dir)
    report = pipe.enable_acceleration("quality", compile_blocks=True)
    _check_report_matches_the_pipeline(pipe, report)
    assert report.enabled["fused_kernels"].startswith("outside the blocks")
    frames = pipe(PROMPT, seed=0, **CALL).frames
    assert np.abs(frames.astype(int) - reference.astype(int)).max() <= 2  # uint8 levels: fp32 reordering


def test_small_hidden_states_on_the_cpu_fuse_only_the_ops_outside_the_blocks(tiny_wan_dir, monkeypatch):
    from metainfer_gen.kernels import common
    from metainfer_gen.video.fuse.core import FUSE_HOOK, _hooks

    large = _pipe(tiny_wan_dir)  # no settings file: diffusers' default size, hidden states above the threshold
    assert large.enable_acceleration("balanced").enabled["fused_kernels"] == "all ops"
    monkeypatch.setattr(common, "COMPILED_MIN_NUMEL", 1 << 40)
    pipe = _pipe(tiny_wan_dir)
    report = pipe.enable_acceleration("balanced")
    assert report.enabled["fused_kernels"].startswith("outside the blocks (in-block ops would run their eager")
    fused = {type(m).__name__ for m in pipe.diffusers_pipeline.transformer.modules() if FUSE_HOOK in _hooks(m)}
    assert fused and not fused & {"WanTransformerBlock", "WanAttention"}
    first, second = (pipe(PROMPT, seed=2, **CALL).frames for _ in range(2))
    np.testing.assert_array_equal(first, second)
