"""fuse_kernels / unfuse_kernels on a tiny diffusers WanTransformer3DModel built from a config.

Tolerances: float32 fused vs unfused transformer output atol = rtol = 1e-5 (the same float32 formulas, reductions
in another order); bfloat16 atol = rtol = 3e-2 (each path rounds once per op, and the differences compound over two
blocks and the output projection).
"""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import audit
from metainfer_gen.video.fuse import FuseKernelsConfig, fuse_kernels, unfuse_kernels
from metainfer_gen.video.fuse.core import FUSE_HOOK, is_fused

ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _tiny_wan(dtype=torch.float32):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads")
    return model.to(dtype).eval()


def _inputs(dtype=torch.float32, per_token=False):
    x = torch.randn(2, 4, 3, 8, 8, dtype=dtype)  # (B, C, F, H, W): 3 x 4 x 4 = 48 tokens
    timestep = torch.randint(0, 1000, (2, 48) if per_token else (2,))
    return x, timestep, torch.randn(2, 5, 16, dtype=dtype)


def _run(model, inputs):
    with torch.no_grad():
        return model(*inputs).sample


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_fused_model_matches_unfused_and_unfuse_restores_forwards(no_interpret, dtype, per_token):
    model = _tiny_wan(dtype)
    inputs = _inputs(dtype, per_token)
    forwards = {name: m.forward for name, m in model.named_modules()}
    expected = _run(model, inputs)
    report = fuse_kernels(model)
    assert sorted(report.fused) == sorted(["rope", "condition_embedder"] + [f"blocks.{i}" for i in range(2)]
                                          + [f"blocks.{i}.attn{j}" for i in range(2) for j in (1, 2)])
    assert report.skipped == {}
    with audit() as trace:
        got = _run(model, inputs)
    torch.testing.assert_close(got, expected, atol=ATOL[dtype], rtol=ATOL[dtype])
    assert set(trace.paths()) == {"adaln_modulate", "gated_residual", "rms_norm", "rope", "timestep_embedding"}
    assert trace.paths()["adaln_modulate"] == {"torch": 4}  # 2 blocks x (norm1, norm3); tiny: eager is fastest
    assert trace.paths()["timestep_embedding"] == {"unique": 1}
    assert unfuse_kernels(model) == 8
    assert not is_fused(model)
    for name, module in model.named_modules():
        assert module.forward == forwards[name], name
    assert torch.equal(_run(model, inputs), expected)


def test_fused_model_runs_the_triton_kernels_and_matches(interpret):
    model = _tiny_wan()
    inputs = _inputs(per_token=True)
    expected = _run(model, inputs)
    fuse_kernels(model)
    with audit() as trace:
        got = _run(model, inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    paths = trace.paths()
    assert paths.pop("timestep_embedding") == {"unique": 1}  # no Triton kernel: torch.unique and a gather
    assert all(p == {"triton": n} for p in paths.values() for n in p.values())
    assert trace.all_fast


def test_config_selects_what_is_fused(no_interpret):
    model = _tiny_wan()
    inputs = _inputs()
    expected = _run(model, inputs)
    report = fuse_kernels(model, FuseKernelsConfig(adaln=False, rope=False, timestep_embedding=False))
    assert report.skipped == {"blocks.0": "adaln disabled in FuseKernelsConfig",
                              "blocks.1": "adaln disabled in FuseKernelsConfig",
                              "condition_embedder": "timestep_embedding disabled in FuseKernelsConfig"}
    with audit() as trace:
        got = _run(model, inputs)
    assert set(trace.paths()) == {"rms_norm"}
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="adaln must be a bool"):
        FuseKernelsConfig(adaln=1)


def test_fusing_twice_or_over_other_hooks_raises():
    from diffusers.hooks import HookRegistry, ModelHook

    model = _tiny_wan()
    fuse_kernels(model)
    with pytest.raises(ValueError, match="already fused"):
        fuse_kernels(model)
    unfuse_kernels(model)
    HookRegistry.check_if_exists_or_initialize(model.blocks[1]).register_hook(ModelHook(), "some_cache")
    with pytest.raises(ValueError, match=r"blocks.1 already has diffusers hooks \['some_cache'\]"):
        fuse_kernels(model)
    assert not is_fused(model)


def test_a_processor_swapped_after_fusing_falls_back_and_is_audited(no_interpret):
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class CustomProcessor(WanAttnProcessor):
        pass

    model = _tiny_wan()
    inputs = _inputs()
    expected = _run(model, inputs)
    fuse_kernels(model)
    model.blocks[0].attn1.set_processor(CustomProcessor())
    with audit() as trace:
        got = _run(model, inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    entry = next(e for e in trace.entries if e.op == "wan_attention")
    assert entry.path == "original" and "CustomProcessor" in entry.refusals[0].reason
    unfuse_kernels(model)
    report = fuse_kernels(model)
    assert report.skipped == {"blocks.0.attn1": "processor is CustomProcessor, not WanAttnProcessor"}
    assert FUSE_HOOK not in getattr(model.blocks[0].attn1, "_diffusers_hook").hooks


def test_audit_of_a_pipeline_call_lists_the_paths_taken(no_interpret, tiny_wan_dir):
    from metainfer_gen.pipelines import TextToVideoPipeline

    pipe = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu", embed_memo=False)  # a bare transformer
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformers[0]
    expected = pipe("a red circle", num_frames=5, height=32, width=32, num_inference_steps=2, seed=0).frames
    fuse_kernels(transformer)
    try:
        with audit() as trace:
            out = pipe("a red circle", num_frames=5, height=32, width=32, num_inference_steps=2, seed=0)
    finally:
        unfuse_kernels(transformer)
    calls = out.stats.transformer_calls
    assert calls >= 2
    paths = trace.paths()
    assert set(paths) == {"adaln_modulate", "gated_residual", "rms_norm", "rope", "timestep_embedding"}
    num_layers = transformer.config.num_layers
    assert sum(paths["adaln_modulate"].values()) == 2 * num_layers * calls
    assert paths["timestep_embedding"] == {"unique": calls}
    assert "WanTransformerBlock.norm1" in trace.summary()
    assert abs(out.frames.astype(int) - expected.astype(int)).max() <= 1  # uint8 frames: rounding at most
