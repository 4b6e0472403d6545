"""CFG batching: both guidance branches in one forward per step. The clip equals the two-call one within one uint8
level (GEMM rounding), for text-to-video, Wan 2.1 image-to-video and Wan 2.2's two experts; a step cache decides
both branches together; guidance off runs as before; a pipeline that breaks the pairing fails loudly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.hooks.hooks import HookRegistry

from metainfer_gen.kernels import audit
from metainfer_gen.video.cfg_batch import CFG_BATCH_HOOK, CfgBatchRecord, cfg_batch_hooks, plan_cfg_batch
from tests.video.cfg_workers import I2V_CALL, OFF_CALL, T2V_CALL, reference_image
from tests.video.wan22 import two_expert_pipeline

STEPS = T2V_CALL["num_inference_steps"]


def _render(pipe, call, *image):
    return pipe(*image, **call)


def _close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


def _no_hook(pipe) -> bool:
    return all(getattr(m, "_diffusers_hook", None) is None or m._diffusers_hook.get_hook(CFG_BATCH_HOOK) is None
               for m in pipe.transformers)


@pytest.mark.parametrize("case", ["t2v", "i2v", "two_experts"])
def test_batched_clip_equals_the_two_call_clip(fresh_t2v, fresh_i2v, tiny_wan_dir, case):
    pipe, call, image = {"t2v": (fresh_t2v, T2V_CALL, ()), "i2v": (fresh_i2v, I2V_CALL, (reference_image(),)),
                         "two_experts": (None, T2V_CALL, ())}[case]
    if pipe is None:
        pipe = two_expert_pipeline(str(tiny_wan_dir))
    plain = _render(pipe, call, *image)
    pipe.enable_cfg_batch()
    with audit() as report:
        batched = _render(pipe, call, *image)
    _close(batched.frames, plain.frames)
    record = batched.stats.extra["cfg_batch"]
    assert (record["path"], record["num_batched_steps"], record["num_unpaired"]) == ("batched", STEPS, 0)
    assert batched.stats.transformer_calls == STEPS and plain.stats.transformer_calls == 2 * STEPS
    assert report.paths()["cfg_batch"] == {"batched": 1}
    assert _no_hook(pipe)


def test_guidance_off_is_one_pass_per_step_unchanged(fresh_t2v):
    plain = _render(fresh_t2v, OFF_CALL)
    fresh_t2v.enable_cfg_batch()
    off = _render(fresh_t2v, OFF_CALL)
    np.testing.assert_array_equal(off.frames, plain.frames)
    assert off.stats.extra["cfg_batch"]["path"] == "single_branch"
    assert "guidance_scale=1.0" in off.stats.extra["cfg_batch"]["reason"]
    assert off.stats.transformer_calls == STEPS and _no_hook(fresh_t2v)


def test_a_step_cache_decides_both_branches_together(fresh_t2v):
    call = {**T2V_CALL, "num_inference_steps": 12}
    fresh_t2v.enable_step_cache("fast")
    plain = _render(fresh_t2v, call)
    fresh_t2v.enable_cfg_batch()
    first, second = _render(fresh_t2v, call), _render(fresh_t2v, call)
    np.testing.assert_array_equal(first.frames, second.frames)
    cache = first.stats.cache
    assert len(cache["per_branch"]) == 1  # one batched call per step
    assert cache["num_computed"] + cache["num_reused"] == 12 and cache["num_reused"] > 0
    assert plain.stats.cache["num_computed"] + plain.stats.cache["num_reused"] == 24
    assert first.stats.transformer_calls == 12  # computed or reused, one call per step reaches the cache


class _Echo(torch.nn.Module):
    """A transformer stand-in: the prediction is hidden_states * scale + the prompt's mean."""

    def forward(self, hidden_states, timestep, encoder_hidden_states, scale=1.0, return_dict=False):
        out = hidden_states * scale + encoder_hidden_states.mean(dim=(1, 2)).view(-1, 1, 1)
        return (out,) if not return_dict else {"sample": out}


class _Pipe:  # named like a paired-call pipeline for the plan
    pass


_Pipe.__name__ = "WanPipeline"


def _session(model):
    return cfg_batch_hooks([model], plan_cfg_batch(_Pipe(), 4.0))


def test_pairs_are_filled_in_place_and_unpaired_calls_run_alone():
    model = _Echo()
    h, t = torch.randn(1, 3, 4), torch.tensor([7.0])
    cond, uncond = torch.randn(1, 2, 5), torch.randn(1, 2, 5)
    with _session(model) as record:
        first = model(h, t, encoder_hidden_states=cond)[0]
        assert first.numel() == 0  # filled at the second call
        second = model(h, t, encoder_hidden_states=uncond)[0]
        torch.testing.assert_close(first, _Echo()(h, t, cond)[0])
        torch.testing.assert_close(second, _Echo()(h, t, uncond)[0])
        a = model(h, t, encoder_hidden_states=cond, scale=2.0)[0]  # a kwarg that differs: no joint forward
        b = model(h, t, encoder_hidden_states=uncond, scale=3.0)[0]
        torch.testing.assert_close(a, _Echo()(h, t, cond, 2.0)[0])
        torch.testing.assert_close(b, _Echo()(h, t, uncond, 3.0)[0])
    assert (record.num_batched_steps, record.num_unpaired) == (1, 1)
    assert HookRegistry.check_if_exists_or_initialize(model).get_hook(CFG_BATCH_HOOK) is None


def test_a_pipeline_that_breaks_the_pairing_fails_loudly():
    model = _Echo()
    h, e = torch.randn(1, 3, 4), torch.randn(1, 2, 5)
    with pytest.raises(RuntimeError, match="differs from the first call"):
        with _session(model):
            model(h, torch.tensor([7.0]), encoder_hidden_states=e)
            model(h, torch.tensor([6.0]), encoder_hidden_states=e)  # a new step before the pair closed
    with pytest.raises(RuntimeError, match="odd number of transformer calls"):
        with _session(model):
            model(h, torch.tensor([7.0]), encoder_hidden_states=e)
    assert HookRegistry.check_if_exists_or_initialize(model).get_hook(CFG_BATCH_HOOK) is None  # removed on failure


def test_a_baseline_cache_keeps_its_two_calls_per_step(fresh_t2v):
    fresh_t2v.enable_cfg_batch()
    fresh_t2v.enable_step_cache("fbcache")
    out = _render(fresh_t2v, T2V_CALL)
    record = out.stats.extra["cfg_batch"]
    assert record["path"] == "sequential" and "the fbcache=0.05 baseline cache" in record["reason"]
    assert out.stats.transformer_calls == 2 * STEPS


def test_the_plan_says_why_it_does_not_batch():
    assert plan_cfg_batch(_Pipe(), None).path == "single_branch"
    assert plan_cfg_batch(_Pipe(), 4.0, context_parallel=True).path == "sequential"
    other = plan_cfg_batch(object(), 4.0)
    assert other.path == "sequential" and "object is not known" in other.reason
    assert CfgBatchRecord("batched", "x").to_dict()["num_batched_steps"] == 0
