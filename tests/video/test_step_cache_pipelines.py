"""Step cache on the user-facing pipelines, on the tiny random Wan checkpoints of ``tests/conftest.py``.

A permissive budget makes reuse certain on random weights; the assertions check what was reused, that the
skipped blocks really did not run (block counter), and that no state survives a call.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

from metainfer_gen.pipelines import ImageToVideoPipeline
from metainfer_gen.video.cache import StepCacheConfig, apply_step_cache, is_step_cache_enabled

PROMPT = "a red circle moving right"
PERMISSIVE = StepCacheConfig(error_budget=1e3, num_warmup_steps=2, max_consecutive_reuses=2)
CALL = dict(num_frames=5, height=32, width=32, num_inference_steps=8, guidance_scale=5.0, seed=0)
NUM_BLOCKS = 2  # of the tiny transformer


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)




def render(pipe, **overrides):
    call = {**CALL, **overrides}
    if isinstance(pipe, ImageToVideoPipeline):
        return pipe(_image(), PROMPT, **call)
    return pipe(PROMPT, **call)


def _assert_reused_and_counted(out, branches):
    cache = out.stats.cache
    assert set(cache["per_branch"]) == set(branches)
    assert all(counts["reused"] > 0 for counts in cache["per_branch"].values()), cache["per_branch"]
    # A computed call runs every block; a reused one none (the default input signal needs no block).
    assert out.stats.block_evaluations == cache["num_computed"] * NUM_BLOCKS


def test_enable_twice_raises_and_disable_removes_every_hook(fresh_t2v):
    fresh_t2v.enable_step_cache("auto")
    with pytest.raises(ValueError, match="already enabled"):
        fresh_t2v.enable_step_cache("fast")
    with pytest.raises(ValueError, match="already enabled"):
        apply_step_cache(fresh_t2v.diffusers_pipeline.transformer, PERMISSIVE)
    fresh_t2v.disable_step_cache()
    transformer = fresh_t2v.diffusers_pipeline.transformer
    assert not is_step_cache_enabled(transformer)
    hooked = [name for name, m in transformer.named_modules() if getattr(m, "_diffusers_hook", None)
              and m._diffusers_hook.hooks]
    assert hooked == []
    fresh_t2v.enable_step_cache("fbcache")  # another policy after disabling is fine
    fresh_t2v.disable_step_cache()


@pytest.mark.parametrize("which", ["fresh_t2v", "fresh_i2v"])
def test_disable_restores_bit_identical_output(which, request):
    pipe = request.getfixturevalue(which)
    before = render(pipe)
    pipe.enable_step_cache(PERMISSIVE)
    cached = render(pipe)
    pipe.disable_step_cache()
    after = render(pipe)
    assert cached.stats.cache["num_reused"] > 0
    assert cached.stats.block_evaluations < before.stats.block_evaluations
    np.testing.assert_array_equal(after.frames, before.frames)
    assert after.stats.cache is None and after.stats.block_evaluations == before.stats.block_evaluations


@pytest.mark.parametrize("which", ["fresh_t2v", "fresh_i2v"])
@pytest.mark.parametrize("guidance_scale, branches", [(5.0, {"cond", "uncond"}), (1.0, {"cond"})])
def test_both_pipelines_reuse_with_cfg_on_and_off(which, guidance_scale, branches, request):
    pipe = request.getfixturevalue(which)
    pipe.enable_step_cache(PERMISSIVE)
    out = render(pipe, guidance_scale=guidance_scale)
    _assert_reused_and_counted(out, branches)
    steps = out.stats.cache["steps"]
    assert all(r["computed"] for r in steps if r["step"] in (0, 1, CALL["num_inference_steps"] - 1))
    assert {r["budget"] for r in steps} == {PERMISSIVE.error_budget}
    assert all(r["signal"] is not None for r in steps if r["step"] > 0)


@pytest.mark.parametrize("which", ["fresh_t2v", "fresh_i2v"])
def test_a_pipeline_that_opens_no_cache_context_still_reuses(which, request, monkeypatch):
    """Regression: caches that need ``cache_context`` fail ("No cache context is set") in such pipelines."""
    pipe = request.getfixturevalue(which)
    pipe.enable_step_cache(PERMISSIVE)
    with_contexts = render(pipe)
    transformer = pipe.diffusers_pipeline.transformer
    monkeypatch.setattr(transformer, "cache_context", lambda name, **kwargs: nullcontext(), raising=False)
    without = render(pipe)
    _assert_reused_and_counted(without, {"branch0", "branch1"})
    np.testing.assert_array_equal(without.frames, with_contexts.frames)


def test_a_second_call_at_another_size_and_step_count_reuses_nothing_stale(fresh_t2v):
    fresh_t2v.enable_step_cache(PERMISSIVE)
    render(fresh_t2v)
    second = render(fresh_t2v, height=48, width=32, num_frames=9, num_inference_steps=6)
    assert second.frames.shape == (9, 48, 32, 3)
    assert second.stats.cache["num_inference_steps"] == 6
    assert max(r["step"] for r in second.stats.cache["steps"]) == 5
    # What a freshly enabled cache gives for the same call: equal only if nothing leaked from the first call.
    fresh_t2v.disable_step_cache()
    fresh_t2v.enable_step_cache(PERMISSIVE)
    fresh = render(fresh_t2v, height=48, width=32, num_frames=9, num_inference_steps=6)
    np.testing.assert_array_equal(second.frames, fresh.frames)
    assert second.stats.cache["steps"] == fresh.stats.cache["steps"]


@pytest.mark.parametrize("steps", [1, 2, 5, 7])
def test_any_step_count_works_and_few_steps_turn_the_cache_off(fresh_t2v, steps):
    baseline = render(fresh_t2v, num_inference_steps=steps)
    fresh_t2v.enable_step_cache(PERMISSIVE)
    out = render(fresh_t2v, num_inference_steps=steps)
    cache = out.stats.cache
    assert out.frames.shape == baseline.frames.shape
    assert [r["step"] for r in cache["steps"] if r["branch"] == "cond"] == list(range(steps))
    if steps < PERMISSIVE.min_steps_for_reuse():
        assert f"num_inference_steps={steps}" in cache["disabled_reason"]
        assert cache["num_reused"] == 0
        np.testing.assert_array_equal(out.frames, baseline.frames)
    else:
        assert cache["disabled_reason"] is None and cache["num_reused"] > 0
        assert all(r["computed"] for r in cache["steps"] if r["step"] == steps - 1)


def test_from_pipe_shares_the_enabled_cache(fresh_t2v):
    fresh_t2v.enable_step_cache(PERMISSIVE)
    ti2v = ImageToVideoPipeline.from_pipe(fresh_t2v)
    out = ti2v(_image(), PROMPT, **CALL)
    assert ti2v.step_cache is fresh_t2v.step_cache and out.stats.cache["num_reused"] > 0


def _load_lora(pipe, seed: int = 1, weight: float = 1.0):
    from tests.video.lora_files import make_lora, state_dict

    lora = make_lora(pipe.diffusers_pipeline.transformer, seed=seed)
    return pipe.load_lora(state_dict(lora, "kohya"), adapter_name=f"lora{seed}", weight=weight)


def test_works_with_a_lora_loaded_and_resets_when_the_adapters_change(fresh_t2v):
    """Issue 3's LoRA case: the cache runs on a LoRA'd model, and a weight change or swap starts it afresh."""
    _load_lora(fresh_t2v)
    uncached = render(fresh_t2v)
    fresh_t2v.enable_step_cache(PERMISSIVE)
    first = render(fresh_t2v)
    _assert_reused_and_counted(first, {"cond", "uncond"})
    assert first.stats.cache["num_computed"] + first.stats.cache["num_reused"] == 2 * CALL["num_inference_steps"]
    assert not np.array_equal(first.frames, uncached.frames)  # it did reuse (the clips differ)...
    fresh_t2v.set_lora_weights({"lora1": 0.5})
    _load_lora(fresh_t2v, seed=2, weight=0.8)
    swapped = render(fresh_t2v)
    root = fresh_t2v.diffusers_pipeline.transformer._diffusers_hook.get_hook("metainfer_step_cache_root")
    assert root.plan_key[-1] == (((("lora1", 0.5), ("lora2", 0.8)), True, False),)  # the plan names the adapters
    # ...and after the swap gives what a freshly enabled cache gives: no state of the first adapters survives.
    fresh_t2v.disable_step_cache()
    fresh_t2v.enable_step_cache(PERMISSIVE)
    fresh = render(fresh_t2v)
    np.testing.assert_array_equal(swapped.frames, fresh.frames)
    assert swapped.stats.cache["steps"] == fresh.stats.cache["steps"]


def test_magcache_recalibrates_after_a_lora_change(fresh_t2v):
    fresh_t2v.enable_step_cache("magcache")
    assert "calibration" in render(fresh_t2v).stats.cache
    assert "calibration" not in render(fresh_t2v).stats.cache
    _load_lora(fresh_t2v)
    assert "calibration" in render(fresh_t2v).stats.cache  # ratios of the base model no longer apply
    assert "calibration" not in render(fresh_t2v).stats.cache


def test_a_stored_calibration_serves_the_base_weights_only(tiny_wan_dir, tmp_path):
    """``step_cache_calibration.json`` describes the base model: with a LoRA active the ratios are fitted online."""
    import shutil

    from metainfer_gen.pipelines import TextToVideoPipeline
    from metainfer_gen.video.cache.calibration import Calibration, Curve

    model = tmp_path / "model"
    shutil.copytree(tiny_wan_dir, model)
    curve = Curve("WanTransformer3DModel", (0.1, 0.9), (1.0, 1.0), (None, None))
    path = Calibration("input", 8, 1, {"transformer": curve}).save(model)
    pipe = TextToVideoPipeline.from_pretrained(model, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_step_cache("auto=1000")
    assert render(pipe).stats.cache["ratios"] == str(path)
    _load_lora(pipe)
    assert render(pipe).stats.cache["ratios"].startswith("online (a LoRA is active")
    pipe.set_lora_weights({"lora1": 0.0})  # inactive: the base weights again
    assert render(pipe).stats.cache["ratios"] == str(path)
