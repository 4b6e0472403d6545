"""The public baselines as policies (diffusers FirstBlockCache, MagCache, TaylorSeer; cache-dit DBCache) on the
tiny T2V and I2V pipelines: each runs at 2 steps, each really skips work where it can, and each removes itself."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from metainfer_gen.pipelines import ImageToVideoPipeline
from metainfer_gen.video.cache.baselines import taylorseer_identifiers

PROMPT = "a red circle moving right"
CALL = dict(num_frames=5, height=32, width=32, guidance_scale=5.0, seed=0)
HAS_CACHE_DIT = importlib.util.find_spec("cache_dit") is not None
POLICIES = ["fbcache", "magcache", "taylorseer",
            pytest.param("dbcache", marks=pytest.mark.skipif(not HAS_CACHE_DIT, reason="cache-dit not installed"))]


def _image() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)




def render(pipe, steps: int):
    if isinstance(pipe, ImageToVideoPipeline):
        return pipe(_image(), PROMPT, num_inference_steps=steps, **CALL)
    return pipe(PROMPT, num_inference_steps=steps, **CALL)


@pytest.mark.parametrize("which", ["fresh_t2v", "fresh_i2v"])
@pytest.mark.parametrize("policy", POLICIES)
def test_each_baseline_runs_at_two_steps_and_removes_itself(which, policy, request):
    pipe = request.getfixturevalue(which)
    plain = render(pipe, 2)
    pipe.enable_step_cache(policy)
    out = render(pipe, 2)
    again = render(pipe, 2)  # a second call: state was reset in between (MagCache now uses its ratios)
    assert out.frames.shape == plain.frames.shape == again.frames.shape
    assert out.stats.cache["policy"].startswith(policy)
    assert 0 < out.stats.block_evaluations <= plain.stats.block_evaluations
    pipe.disable_step_cache()
    np.testing.assert_array_equal(render(pipe, 2).frames, plain.frames)


@pytest.mark.parametrize("which", ["fresh_t2v", "fresh_i2v"])
@pytest.mark.parametrize("policy", ["fbcache=10", "magcache=10", "taylorseer=2",
                                    pytest.param("dbcache=10", marks=pytest.mark.skipif(
                                        not HAS_CACHE_DIT, reason="cache-dit not installed"))])
def test_each_baseline_skips_blocks_at_a_permissive_setting(which, policy, request):
    pipe = request.getfixturevalue(which)
    steps = 12  # past cache-dit's default 8 warm-up steps
    plain = render(pipe, steps)
    pipe.enable_step_cache(policy)
    first = render(pipe, steps)
    second = render(pipe, steps)
    if policy.startswith("magcache"):  # the first call calibrates, skipping nothing
        assert "calibration" in first.stats.cache
        assert first.stats.block_evaluations == plain.stats.block_evaluations
    assert second.stats.block_evaluations < plain.stats.block_evaluations


def test_taylorseer_identifiers_match_wan_attention_and_ffn(fresh_t2v):
    names = taylorseer_identifiers(fresh_t2v.diffusers_pipeline.transformer)
    assert names == [r"blocks\.0\.attn1", r"blocks\.0\.attn2", r"blocks\.0\.ffn",
                     r"blocks\.1\.attn1", r"blocks\.1\.attn2", r"blocks\.1\.ffn"]


def test_a_baseline_and_ours_cannot_stack(fresh_t2v):
    fresh_t2v.enable_step_cache("fbcache")
    with pytest.raises(ValueError, match="already enabled"):
        fresh_t2v.enable_step_cache("auto")
    from metainfer_gen.video.cache import StepCacheConfig, apply_step_cache

    with pytest.raises(ValueError, match="diffusers cache"):
        apply_step_cache(fresh_t2v.diffusers_pipeline.transformer, StepCacheConfig())
