"""The named presets stand aside below ``min_inference_steps`` (``min_unguided_inference_steps`` without guidance):
guided, at 4-8 steps their reuse lost the clip; unguided (the step LoRA), at 4.

On the embedded model at 81 frames, ``enable_step_cache("auto")`` at 4 steps kept 18-20 dB against the uncached
clip and changed the colour or direction of 3 clips in 8 (``benchmarks/step_cache_few_steps.py``). Below the
floor the call computes every step, exactly as without the cache, and the stats say why; at the floor or above,
reuse is what it was. A ``StepCacheConfig`` built directly has no floor unless it sets one, so permissive configs
at 2-5 steps keep reusing.
"""

from __future__ import annotations

import numpy as np
import pytest

from metainfer_gen.video.cache import StepCacheConfig

PROMPT = "a red circle moving right"
TINY = dict(num_frames=5, height=32, width=32, guidance_scale=5.0, seed=0)


def _floor(name: str) -> int:
    return StepCacheConfig.preset(name).min_inference_steps


@pytest.fixture(scope="module")
def embedded():
    from metainfer_gen import pipelines

    pipe = pipelines.TextToVideoPipeline.from_pretrained(device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _cached(pipe, cache, **call):
    pipe.enable_step_cache(cache)
    try:
        return pipe(PROMPT, **call)
    finally:
        pipe.disable_step_cache()


def test_auto_at_4_steps_on_the_embedded_model_computes_every_step_and_says_why(embedded):
    call = dict(num_inference_steps=4, seed=3)
    out = _cached(embedded, "auto", **call)
    cache = out.stats.cache
    assert cache["num_reused"] == 0, cache["per_branch"]
    reason = cache["disabled_reason"] or ""
    assert "num_inference_steps=4" in reason and "min_inference_steps=" in reason, reason
    np.testing.assert_array_equal(out.frames, embedded(PROMPT, **call).frames)


@pytest.mark.parametrize("name", ["quality", "auto", "fast"])
def test_every_preset_stands_aside_just_below_its_floor(fresh_t2v, name):
    floor = _floor(name)
    assert isinstance(floor, int) and floor > StepCacheConfig.preset(name).min_steps_for_reuse()
    call = dict(TINY, num_inference_steps=floor - 1)
    baseline = fresh_t2v(PROMPT, **call)
    out = _cached(fresh_t2v, f"{name}=1000", **call)  # a huge budget: it would reuse if it could
    cache = out.stats.cache
    assert f"min_inference_steps={floor}" in cache["disabled_reason"]
    assert f"num_inference_steps={floor - 1}" in cache["disabled_reason"]
    assert cache["num_reused"] == 0 and out.stats.block_evaluations == baseline.stats.block_evaluations
    np.testing.assert_array_equal(out.frames, baseline.frames)


@pytest.mark.parametrize("name", ["quality", "auto", "fast"])
def test_at_the_floor_a_preset_reuses_as_without_it(fresh_t2v, name):
    from metainfer_gen.video.cache.policy import StepCachePolicy

    call = dict(TINY, num_inference_steps=_floor(name))
    guarded = _cached(fresh_t2v, f"{name}=1000", **call)
    unguarded = StepCacheConfig.preset(name, error_budget=1000.0, min_inference_steps=None)
    free = _cached(fresh_t2v, StepCachePolicy(unguarded, name=f"{name}=1000", find_calibration=True), **call)
    assert guarded.stats.cache["disabled_reason"] is None and guarded.stats.cache["num_reused"] > 0
    assert guarded.stats.cache["steps"] == free.stats.cache["steps"]
    np.testing.assert_array_equal(guarded.frames, free.frames)


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_a_config_built_directly_has_no_floor_and_a_permissive_one_reuses_at_2_steps(fresh_t2v, guidance_scale):
    from metainfer_gen.video.cache.calibration import Calibration, Curve

    # Ratios from a calibration: fitted online, they need two computed steps first, which 2 steps do not leave.
    curve = Curve("WanTransformer3DModel", (0.0, 1.0), (1.0, 1.0), (None, None))
    config = StepCacheConfig(error_budget=1e3, num_warmup_steps=1, warmup_fraction=0.0, compute_last_step=False,
                             calibration=Calibration("input", 2, 1, {"transformer": curve}))
    assert config.min_inference_steps is None
    out = _cached(fresh_t2v, config, **dict(TINY, num_inference_steps=2, guidance_scale=guidance_scale))
    assert out.stats.cache["disabled_reason"] is None
    assert all(counts["reused"] == 1 for counts in out.stats.cache["per_branch"].values())


def test_a_config_that_sets_the_floor_gets_it(fresh_t2v):
    config = StepCacheConfig(error_budget=1e3, max_consecutive_reuses=2, min_inference_steps=9)
    below = _cached(fresh_t2v, config, **dict(TINY, num_inference_steps=8)).stats.cache
    assert "min_inference_steps=9" in below["disabled_reason"] and below["num_reused"] == 0
    at = _cached(fresh_t2v, config, **dict(TINY, num_inference_steps=9)).stats.cache
    assert at["disabled_reason"] is None and at["num_reused"] > 0


def test_presets_take_an_override_of_the_floor():
    assert StepCacheConfig.preset("fast", min_inference_steps=4).min_inference_steps == 4
    assert StepCacheConfig.preset("auto", min_inference_steps=None).min_inference_steps is None
    assert StepCacheConfig.preset("auto") == StepCacheConfig.preset("balanced")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_a_bad_floor_raises_naming_the_field(bad):
    with pytest.raises(ValueError, match="min_inference_steps must be an integer >= 1 or None"):
        StepCacheConfig(min_inference_steps=bad)


def test_the_reason_is_plain_bookkeeping_checked_in_order():
    config = StepCacheConfig(num_warmup_steps=2, min_inference_steps=10)
    assert config.reuse_off_reason(None) is None  # step count unknown (a custom loop): no floor to apply
    assert "is below 4: warm-up (2)" in config.reuse_off_reason(3)  # no step to reuse comes first
    assert "min_inference_steps=10" in config.reuse_off_reason(9)
    assert config.reuse_off_reason(10) is None
    assert "min_inference_steps=10" in config.reuse_off_reason(9, guided=False)  # no unguided floor: the same one


def test_the_unguided_floor_is_lower_and_named_in_the_reason():
    config = StepCacheConfig.preset("auto")
    assert (config.min_inference_steps, config.min_unguided_inference_steps) == (10, 6)
    assert "min_unguided_inference_steps=6" in config.reuse_off_reason(5, guided=False)
    assert config.reuse_off_reason(6, guided=False) is None
    assert "min_inference_steps=10" in config.reuse_off_reason(6, guided=True)
    with pytest.raises(ValueError, match="min_unguided_inference_steps must be an integer >= 1 or None"):
        StepCacheConfig(min_unguided_inference_steps=0)


def test_the_step_lora_is_computed_in_full_at_4_steps_and_reuses_above_30_db_at_8(embedded):
    """The shipped step LoRA, unguided: at 4 steps the preset stands aside (reuse kept 28 dB in the benchmark) and
    says why; at 8 it reuses and keeps at least 30 dB against the uncached 8-step clip."""
    from metainfer_gen.video.quality import psnr

    from metainfer_gen.pipelines.loading import default_lora_dir

    embedded.load_lora(default_lora_dir() / "steps_4_8.safetensors", adapter_name="steps")
    try:
        four = dict(num_inference_steps=4, guidance_scale=1.0, seed=3)
        out = _cached(embedded, "auto", **four)
        assert out.stats.cache["num_reused"] == 0
        assert "min_unguided_inference_steps=6" in out.stats.cache["disabled_reason"]
        np.testing.assert_array_equal(out.frames, embedded(PROMPT, **four).frames)
        eight = dict(four, num_inference_steps=8)
        out = _cached(embedded, "auto", **eight)
        assert out.stats.cache["disabled_reason"] is None and out.stats.cache["num_reused"] > 0
        assert psnr(out.frames, embedded(PROMPT, **eight).frames) >= 30.0
    finally:
        embedded.unload_lora("steps")
