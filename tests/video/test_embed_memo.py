"""The condition-embedder memo as its own lossless accelerator: bit-identical outputs with and without it (alone,
under our step cache and under each baseline cache, over fused kernels in either order), real reuse (calls of the
embedder's inner linears), per-call state, and removal of every hook. The step cache no longer installs it."""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager

import pytest
import torch

from metainfer_gen.video.cache import StepCacheConfig, apply_embed_memo, apply_step_cache, remove_embed_memo
from metainfer_gen.video.cache.embed_memo import get_embed_memo
from tests.video.test_step_cache_models import FAMILIES, NUM_STEPS, denoise

PROMPT = "a red circle moving right"
STEPS = 6
CALL = dict(num_frames=5, height=32, width=32, num_inference_steps=STEPS, guidance_scale=5.0, seed=0)
PERMISSIVE = StepCacheConfig(error_budget=1e3, num_warmup_steps=2, max_consecutive_reuses=2)
HAS_CACHE_DIT = importlib.util.find_spec("cache_dit") is not None


def _hooked(model) -> list[str]:
    """Names of the modules of ``model`` that carry any diffusers hook."""
    return [name for name, m in model.named_modules()
            if getattr(m, "_diffusers_hook", None) and m._diffusers_hook.hooks]


@contextmanager
def _recorded(pipe):
    """Every transformer output of the calls inside, and the calls of the embedder's inner linears."""
    transformer = pipe.diffusers_pipeline.transformer
    embedder = transformer.condition_embedder
    seen = {"outputs": [], "text": 0, "time": 0}

    def count(key):
        return lambda module, args, output: seen.__setitem__(key, seen[key] + 1)

    handles = [transformer.register_forward_hook(lambda m, args, out: seen["outputs"].append(out[0].clone())),
               embedder.text_embedder.linear_1.register_forward_hook(count("text")),
               embedder.time_embedder.linear_1.register_forward_hook(count("time"))]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _render(pipe, **overrides):
    with _recorded(pipe) as seen:
        out = pipe(PROMPT, **{**CALL, **overrides})
    seen["blocks"] = out.stats.block_evaluations
    return seen


def _assert_same(got: dict, want: dict) -> None:
    assert len(got["outputs"]) == len(want["outputs"]) > 0
    assert all(torch.equal(g, w) for g, w in zip(got["outputs"], want["outputs"]))


def test_the_memo_is_bit_identical_and_reuses_the_embedder(fresh_t2v):
    plain = _render(fresh_t2v)
    assert plain["text"] == plain["time"] == 2 * STEPS  # one embedder run per transformer call (CFG: two per step)
    fresh_t2v.enable_embed_memo()
    assert fresh_t2v.embed_memo_enabled
    memo = get_embed_memo(fresh_t2v.diffusers_pipeline.transformer)
    got = _render(fresh_t2v)
    _assert_same(got, plain)
    # The timestep is embedded once per step; the unconditional prompt once per call, the conditional one on
    # each step's first call (it comes with that step's new timestep from the embedder's own forward).
    assert got["time"] == STEPS
    assert got["text"] == STEPS + 1
    assert memo.num_hits == 2 * STEPS - 1  # every second branch's timestep, and its prompt after the first step
    assert memo.time is None and memo.text == []  # forgotten at the end of the call
    again = _render(fresh_t2v)
    _assert_same(again, plain)
    assert again["time"] == STEPS  # nothing carried into the next call beyond what it recomputes itself


def test_disable_removes_every_hook_and_enable_is_idempotent(fresh_t2v):
    transformer = fresh_t2v.diffusers_pipeline.transformer
    plain = _render(fresh_t2v)
    fresh_t2v.enable_embed_memo()
    fresh_t2v.enable_embed_memo()  # already on: left as it is
    with pytest.raises(ValueError, match="already applied"):
        apply_embed_memo(transformer)
    assert _hooked(transformer) == ["condition_embedder"]
    fresh_t2v.disable_embed_memo()
    assert not fresh_t2v.embed_memo_enabled and _hooked(transformer) == []
    with pytest.raises(ValueError, match="not applied"):
        remove_embed_memo(transformer)
    fresh_t2v.disable_embed_memo()  # no-op
    again = _render(fresh_t2v)
    _assert_same(again, plain)
    assert again["time"] == 2 * STEPS


def test_the_step_cache_no_longer_installs_the_memo(fresh_t2v):
    transformer = fresh_t2v.diffusers_pipeline.transformer
    fresh_t2v.enable_step_cache("auto")
    assert "condition_embedder" not in _hooked(transformer)
    fresh_t2v.disable_step_cache()
    apply_step_cache(transformer, PERMISSIVE)
    assert "condition_embedder" not in _hooked(transformer)


@pytest.mark.parametrize("policy", [
    "ours", "fbcache=10", "magcache=10", "taylorseer=2",
    pytest.param("dbcache=10", marks=pytest.mark.skipif(not HAS_CACHE_DIT, reason="cache-dit not installed"))])
def test_the_memo_under_each_cache_is_bit_identical_to_the_cache_alone(fresh_t2v, policy):
    """Permissive settings, so each cache really skips blocks; the memo changes none of its outputs."""
    steps = 12 if policy.startswith("dbcache") else STEPS  # past cache-dit's 8 warm-up steps
    fresh_t2v.enable_step_cache(PERMISSIVE if policy == "ours" else policy)
    first = _render(fresh_t2v, num_inference_steps=steps)  # MagCache calibrates on this call; the others just run
    plain = _render(fresh_t2v, num_inference_steps=steps)
    assert plain["blocks"] < 2 * steps * len(fresh_t2v.diffusers_pipeline.transformer.blocks)  # it skipped
    fresh_t2v.enable_embed_memo()
    got = _render(fresh_t2v, num_inference_steps=steps)
    _assert_same(got, plain)
    assert got["time"] < plain["time"]  # the embedder runs on every call the cache makes, the memo still reuses
    if not policy.startswith("magcache"):
        _assert_same(first, plain)
    if policy == "ours":
        assert fresh_t2v.diffusers_pipeline.transformer.blocks[1]._diffusers_hook.hooks  # the cache is there
    fresh_t2v.disable_step_cache()
    fresh_t2v.disable_embed_memo()
    assert _hooked(fresh_t2v.diffusers_pipeline.transformer) == []


@pytest.mark.parametrize("order", ["memo-first", "kernels-first"])
def test_the_memo_and_fused_kernels_compose_in_either_order(fresh_t2v, order):
    from metainfer_gen.video.fuse import FuseKernelsConfig

    kernels = FuseKernelsConfig(adaln=False, qk_norm=False, rope=False)  # the fused condition embedder
    fresh_t2v.enable_fused_kernels(vae=False, config=kernels)
    plain = _render(fresh_t2v)
    fresh_t2v.disable_fused_kernels()
    if order == "memo-first":
        fresh_t2v.enable_embed_memo()
        fresh_t2v.enable_fused_kernels(vae=False, config=kernels)
    else:
        fresh_t2v.enable_fused_kernels(vae=False, config=kernels)
        fresh_t2v.enable_embed_memo()
    memo = get_embed_memo(fresh_t2v.diffusers_pipeline.transformer)
    _assert_same(_render(fresh_t2v), plain)
    assert memo.num_hits == 2 * STEPS - 1  # outermost: it runs before the fused embedder
    fresh_t2v.disable_fused_kernels()  # the memo stays, and still reuses
    memo = get_embed_memo(fresh_t2v.diffusers_pipeline.transformer)
    assert _render(fresh_t2v)["time"] == STEPS and memo.num_hits == 2 * STEPS - 1


def test_the_memo_on_a_hand_written_loop_and_its_refusals():
    torch.manual_seed(0)
    model, latents, extra = FAMILIES["wan"]()
    model.eval()
    reference = denoise(model, latents, extra, contexts=True)
    memo = apply_embed_memo(model)
    assert torch.equal(denoise(model, latents, extra, contexts=True), reference)
    # Both branches share one prompt embedding here: the second call of each step finds its timestep and prompt.
    assert memo.num_hits == 2 * NUM_STEPS
    remove_embed_memo(model)
    assert _hooked(model) == []
    for name in ("cogvideox", "ltx"):
        with pytest.raises(ValueError, match="cannot apply the embed memo: .*condition_embedder"):
            apply_embed_memo(FAMILIES[name]()[0])


def test_the_memo_over_fused_kernels_keeps_the_fused_embedder():
    from metainfer_gen.kernels import audit
    from metainfer_gen.video.fuse import FuseKernelsConfig, fuse_kernels, unfuse_kernels

    torch.manual_seed(0)
    model, latents, extra = FAMILIES["wan"]()
    model.eval()
    fuse_kernels(model, FuseKernelsConfig(adaln=False, qk_norm=False, rope=False))
    reference = denoise(model, latents, extra, contexts=True)
    memo = apply_embed_memo(model)
    with audit() as trace:
        got = denoise(model, latents, extra, contexts=True)
    assert torch.equal(got, reference)  # the memo only skips repeats of the fused computation
    assert trace.paths() == {"timestep_embedding": {"unique": NUM_STEPS}}  # once per step, not per branch
    assert memo.num_hits == 2 * NUM_STEPS
    remove_embed_memo(model)
    assert unfuse_kernels(model) == 2  # the condition embedder and the rotary-table memo


def test_the_pipeline_refuses_the_memo_on_a_model_without_wan_embedder(fresh_t2v, monkeypatch):
    monkeypatch.setattr(type(fresh_t2v), "transformers", property(lambda self: [torch.nn.Linear(2, 2)]))
    with pytest.raises(ValueError, match="no condition_embedder"):
        fresh_t2v.enable_embed_memo()


def test_a_failed_call_leaves_nothing_in_the_memo(fresh_t2v, monkeypatch):
    """diffusers resets stateful hooks only at the end of a call that finishes; the pipeline resets the memo anyway."""
    fresh_t2v.enable_embed_memo()
    memo = get_embed_memo(fresh_t2v.diffusers_pipeline.transformer)
    scheduler = fresh_t2v.diffusers_pipeline.scheduler
    step = scheduler.step
    calls = []

    def failing_step(*args, **kwargs):
        calls.append(memo.time is not None)  # the memo holds this step's timestep here
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return step(*args, **kwargs)

    monkeypatch.setattr(scheduler, "step", failing_step)
    with pytest.raises(RuntimeError, match="interrupted"):
        fresh_t2v(PROMPT, **CALL)
    assert calls == [True, True]
    assert memo.time is None and memo.text == []
