"""Gate-aware residuals on Wan blocks: the assembled residual equals the blocks' own, reused steps built from it
track the uncached run more closely than the gated sum, and removal takes the capture hooks off."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.video.cache import StepCacheConfig, apply_step_cache, remove_step_cache
from metainfer_gen.video.cache.apply import begin_step_cache_call, end_step_cache_call
from metainfer_gen.video.cache.blocks import find_blocks
from metainfer_gen.video.cache.gated import CAPTURE_HOOK, GatedBlocks
from tests.video.test_step_cache_models import FAMILIES, NUM_STEPS, denoise


def _wan():
    model, latents, extra = FAMILIES["wan"]()
    return model.eval(), latents, extra


def _hooked(module) -> list[str]:
    registry = getattr(module, "_diffusers_hook", None)
    return list(registry.hooks) if registry is not None else []


@pytest.mark.parametrize("per_token", [False, True], ids=["temb-per-sample", "temb-per-token"])
def test_assembled_residual_equals_the_blocks_own(per_token):
    torch.manual_seed(0)
    model, latents, extra = _wan()
    blocks = [block for _, block in find_blocks(model)]
    gated = GatedBlocks.of(blocks)
    assert gated is not None and len(gated.tables) == len(blocks)
    seen = {}
    first = blocks[0].register_forward_pre_hook(lambda m, args, kwargs: seen.update(x=args[0], temb=args[2]),
                                                with_kwargs=True)
    head = blocks[0].register_forward_hook(lambda m, args, out: seen.update(head=out))
    last = blocks[-1].register_forward_hook(lambda m, args, out: seen.update(out=out))
    tokens = latents.shape[2] * (latents.shape[3] // 2) * (latents.shape[4] // 2)
    timestep = torch.full((1, tokens), 700.0) if per_token else torch.tensor([700.0])
    summaries = []
    for skip in (0, 1):  # all blocks, then the blocks after the first
        gated.start_capture()
        with torch.no_grad():
            model(hidden_states=latents, timestep=timestep, return_dict=False, **extra)
        summaries.append(gated.take_capture(skip_blocks=skip))
    for handle in (first, head, last):
        handle.remove()
    assert seen["temb"].ndim == (4 if per_token else 3)
    residual = gated.residual(seen["temb"], summaries[0], seen["x"].dtype)
    torch.testing.assert_close(residual, seen["out"] - seen["x"], atol=1e-5, rtol=1e-5)
    later = gated.residual(seen["temb"], summaries[1], seen["x"].dtype)
    torch.testing.assert_close(later, seen["out"] - seen["head"], atol=1e-5, rtol=1e-5)
    assert gated.take_capture(0) is None  # capture stopped: nothing more is kept


def test_other_block_families_keep_the_gated_sum():
    for name in ("cogvideox", "ltx", "hunyuan"):
        model, _, _ = FAMILIES[name]()
        assert GatedBlocks.of([block for _, block in find_blocks(model)]) is None, name


@pytest.mark.parametrize("signal", ["input", "first_block"])
def test_gate_aware_reuse_tracks_the_uncached_run_closer_and_removal_unhooks(signal):
    """With ``first_block`` the residual covers the blocks after the first (its summary skips one block)."""
    torch.manual_seed(0)
    model, latents, extra = _wan()
    reference = denoise(model, latents, extra, contexts=True)
    errors = {}
    for gate_aware in (True, False):
        config = StepCacheConfig(error_budget=1e3, num_warmup_steps=2, max_consecutive_reuses=2,
                                 cap_reference_steps=None, gate_aware=gate_aware, signal=signal)
        apply_step_cache(model, config)
        assert any(CAPTURE_HOOK in _hooked(m) for m in model.modules()) == gate_aware
        begin_step_cache_call(model, NUM_STEPS)
        cached = denoise(model, latents, extra, contexts=True)
        stats = end_step_cache_call(model)
        assert stats.num_reused > 0
        errors[gate_aware] = (cached - reference).abs().mean().item()
        remove_step_cache(model)
        assert not any(CAPTURE_HOOK in _hooked(m) for m in model.modules())
    assert errors[True] < 0.8 * errors[False], errors
    assert torch.equal(denoise(model, latents, extra, contexts=True), reference)

