"""The step cache on each diffusers video transformer family, built from tiny configs, in a hand-written
denoising loop (with and without cache contexts), and on a Wan 2.2-style pipeline with two experts."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import pytest
import torch

from metainfer_gen.video.cache import StepCacheConfig, apply_step_cache, count_block_evaluations, remove_step_cache
from metainfer_gen.video.cache.apply import begin_step_cache_call, end_step_cache_call

PERMISSIVE = StepCacheConfig(error_budget=1e3, num_warmup_steps=2, max_consecutive_reuses=2)
NUM_STEPS = 7


def _hunyuan():
    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))
    extra = dict(encoder_hidden_states=torch.randn(1, 6, 16), pooled_projections=torch.randn(1, 8),
                 encoder_attention_mask=torch.ones(1, 6), guidance=torch.tensor([3000.0]))
    return model, torch.randn(1, 4, 1, 8, 8), extra


def _cogvideox():
    from diffusers import CogVideoXTransformer3DModel

    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8, sample_frames=8, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8)
    return model, torch.randn(1, 2, 4, 8, 8), dict(encoder_hidden_states=torch.randn(1, 8, 8))


def _ltx():
    from diffusers import LTXVideoTransformer3DModel

    model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                       cross_attention_dim=16, num_layers=2, caption_channels=16)
    extra = dict(encoder_hidden_states=torch.randn(1, 6, 16), encoder_attention_mask=torch.ones(1, 6),
                 num_frames=2, height=4, width=4)
    return model, torch.randn(1, 2 * 4 * 4, 4), extra


def _wan():
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2)
    return model, torch.randn(1, 4, 2, 8, 8), dict(encoder_hidden_states=torch.randn(1, 6, 16))


FAMILIES = {"hunyuan": _hunyuan, "cogvideox": _cogvideox, "ltx": _ltx, "wan": _wan}


def denoise(model, latents, extra, contexts: bool, branches=("cond", "uncond")) -> torch.Tensor:
    """Euler steps over t = 900 .. 100 with one model call per branch per step; returns the final latents."""
    for t in torch.linspace(900, 100, NUM_STEPS):
        predictions = []
        for branch in branches:
            scope = model.cache_context(branch) if contexts else nullcontext()
            with scope, torch.no_grad():
                predictions.append(model(hidden_states=latents, timestep=t.reshape(1), return_dict=False,
                                         **extra)[0])
        latents = latents - 0.1 * sum(predictions) / len(predictions)
    return latents


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    torch.manual_seed(0)
    model, latents, extra = FAMILIES[request.param]()
    return model.eval(), latents, extra


@pytest.mark.parametrize("contexts, signal", [(True, "input"), (False, "first_block")],
                         ids=["contexts-input", "no-context-first-block"])
def test_each_family_reuses_and_removal_restores_exact_output(family, contexts, signal):
    model, latents, extra = family
    reference = denoise(model, latents, extra, contexts)
    apply_step_cache(model, replace(PERMISSIVE, signal=signal))
    begin_step_cache_call(model, NUM_STEPS)
    with count_block_evaluations([model]) as counter:
        cached = denoise(model, latents, extra, contexts)
    stats = end_step_cache_call(model)
    assert stats.num_reused > 0 and torch.isfinite(cached).all()
    assert {r.branch for r in stats.steps} == ({"cond", "uncond"} if contexts else {"branch0", "branch1"})
    assert all(r.computed for r in stats.steps if r.step in (0, 1, NUM_STEPS - 1))
    # A reused call runs no block with the input signal, the first block with the first-block signal.
    head = stats.num_reused if signal == "first_block" else 0
    assert counter.num_evaluations == stats.num_computed * counter.num_blocks + head
    remove_step_cache(model)
    assert torch.equal(denoise(model, latents, extra, contexts), reference)


def test_branches_keep_separate_state(family):
    """Reusing in one branch must add that branch's residual: a cond-only run equals the cond part of a CFG run
    only if the uncond branch never touched the cond state."""
    model, latents, extra = family
    apply_step_cache(model, PERMISSIVE)
    begin_step_cache_call(model, NUM_STEPS)
    alone = denoise(model, latents, extra, contexts=True, branches=("cond",))
    end_step_cache_call(model)
    begin_step_cache_call(model, NUM_STEPS)
    twice = denoise(model, latents, extra, contexts=True, branches=("cond", "cond2"))
    stats = end_step_cache_call(model)
    # Both branches see identical inputs, so with separate states they decide and compute identically.
    assert torch.allclose(twice, alone, atol=1e-5)
    decisions = {b: [r.computed for r in stats.steps if r.branch == b] for b in ("cond", "cond2")}
    assert decisions["cond"] == decisions["cond2"] and not all(decisions["cond"])


def test_wan22_two_experts_get_separate_state_and_both_reuse(tiny_wan_dir):
    from tests.video.wan22 import two_expert_pipeline

    pipe = two_expert_pipeline(tiny_wan_dir)
    plain = pipe("a red circle moving right", num_frames=5, height=32, width=32, num_inference_steps=12,
                 guidance_scale=5.0, seed=0)
    pipe.enable_step_cache(PERMISSIVE)
    out = pipe("a red circle moving right", num_frames=5, height=32, width=32, num_inference_steps=12,
               guidance_scale=5.0, seed=0)
    steps = out.stats.cache["steps"]
    models = {r["model"] for r in steps}
    assert models == {"transformer", "transformer_2"}
    for name in models:
        mine = [r for r in steps if r["model"] == name]
        assert any(not r["computed"] for r in mine), name
        first = min(r["step"] for r in mine)  # each expert warms up on its own state
        assert all(r["computed"] for r in mine if r["step"] <= first + 1)
    assert [r["step"] for r in steps if r["branch"] == "cond"] == list(range(12))
    assert out.stats.block_evaluations < plain.stats.block_evaluations
    # Step accounting per expert: the low-noise expert's span starts at step 0 of its own, each span's last step is
    # computed (no reuse across the switch), and the stats count each expert apart.
    spans = {name: [r for r in steps if r["model"] == name and r["branch"] == "cond"] for name in models}
    high = len(spans["transformer"])
    assert 0 < high < 12 and [r["step"] for r in spans["transformer_2"]] == list(range(high, 12))
    for name, span in spans.items():
        assert [r["model_step"] for r in span] == list(range(len(span))), name
    assert spans["transformer"][-1]["computed"] and spans["transformer"][-1]["reason"] == "last step"
    per_model = out.stats.cache["per_model"]
    assert set(per_model) == models and all(counts["reused"] > 0 for counts in per_model.values())
    assert sum(c["computed"] + c["reused"] for c in per_model.values()) == 24  # 12 steps x 2 branches
    pipe.disable_step_cache()
    again = pipe("a red circle moving right", num_frames=5, height=32, width=32, num_inference_steps=12,
                 guidance_scale=5.0, seed=0)
    assert np.array_equal(again.frames, plain.frames)


def test_residuals_are_extrapolated_over_the_step_index_not_the_timestep(monkeypatch):
    """Schedulers space steps evenly in their own coordinate, not in the (shifted) timestep: the positions the
    residuals are stored and extrapolated at are the step numbers, whatever the timesteps."""
    from metainfer_gen.video.cache.state import BranchState

    torch.manual_seed(0)
    model, latents, extra = FAMILIES["wan"]()
    seen = {"store": [], "estimate": []}
    for name in seen:
        original = getattr(BranchState, name)

        def spy(self, position, *args, _original=original, _name=name, **kwargs):
            seen[_name].append(position)
            return _original(self, position, *args, **kwargs)

        monkeypatch.setattr(BranchState, name, spy)
    apply_step_cache(model.eval(), PERMISSIVE)
    timesteps = [999.0, 990.0, 950.0, 800.0, 400.0, 100.0, 20.0]  # shifted-schedule-like: dense early
    begin_step_cache_call(model, len(timesteps))
    with torch.no_grad():
        for t in timesteps:
            latents = latents - 0.1 * model(hidden_states=latents, timestep=torch.tensor([t]), return_dict=False,
                                            **extra)[0]
    stats = end_step_cache_call(model)
    remove_step_cache(model)
    assert seen["store"] == [float(r.step) for r in stats.steps if r.computed]
    reused = [float(r.step) for r in stats.steps if not r.computed]
    # Reused steps estimate their residual; computed ones after two others measure the extrapolation's error.
    assert reused and set(reused) <= set(seen["estimate"]) <= {float(r.step) for r in stats.steps}
