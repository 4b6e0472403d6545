"""CFG-parallel denoising: on two CPU ranks (gloo + shared memory) the clip equals the single-process one, for
text-to-video and image-to-video; guidance off and a one-process world fall back and say why.

The two-rank cases run in one launch (:func:`cfg_parallel_cases`, module fixture); the tests compare them with
the same calls made here, in one process, on the tiny Wan pipelines of ``tests/conftest.py`` (2 steps, 5 frames,
32x32).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.collectives.harness import run_ranks
from tests.video.cfg_workers import CLI_ARGS, I2V_CALL, OFF_CALL, T2V_CALL, load, reference_image, render

ATOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tiny_wan_dir, tiny_wan_i2v_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cfg_parallel")
    # 900 s: a liveness guard for loaded machines; the launch takes seconds on an idle one.
    results = run_ranks("tests.video.cfg_workers:cfg_parallel_cases", tmp, timeout_s=900, t2v=str(tiny_wan_dir),
                        i2v=str(tiny_wan_i2v_dir), clip=str(tmp / "clip.mp4"))
    return {"results": results, "clip": tmp / "clip.mp4"}


@pytest.fixture(scope="module")
def single(tiny_wan_dir, tiny_wan_i2v_dir):
    """The same calls in this process, without CFG parallelism."""
    t2v = load("TextToVideoPipeline", str(tiny_wan_dir))
    i2v = load("ImageToVideoPipeline", str(tiny_wan_i2v_dir))
    return {"t2v": render(t2v, T2V_CALL), "off": render(t2v, OFF_CALL), "i2v": render(i2v, I2V_CALL, reference_image())}


def _assert_same_clip(got: dict, want: dict) -> None:
    np.testing.assert_allclose(got["latents"], want["latents"], atol=ATOL, rtol=0)
    assert np.array_equal(got["frames"], want["frames"])


@pytest.mark.parametrize("case", ["t2v", "i2v"])
def test_cfg_parallel_clip_equals_the_single_process_clip(ranks, single, case):
    for rank, out in ranks["results"].items():
        _assert_same_clip(out[case], single[case])
        record = out[case]["stats"]["extra"]["cfg_parallel"]
        assert (record["path"], record["rank"], record["group_size"]) == ("cfg_parallel", rank, 2)
        assert (record["num_exchanges"], record["num_skipped_calls"]) == (2, 2)  # one per step
        assert out[case]["stats"]["transformer_calls"] == 2  # this rank's branch only; one process makes 4
        assert out[case]["paths"]["cfg_parallel"] == {"cfg_parallel": 1}
        assert out[case]["paths"]["all_gather"] == {"shm_all_gather": 3}  # the seed agreement + one per step
        assert out[case]["refusals"] == []
    assert single[case]["stats"]["transformer_calls"] == 4


def test_guidance_off_falls_back_and_says_why(ranks, single):
    for rank, out in ranks["results"].items():
        _assert_same_clip(out["off"], single["off"])
        record = out["off"]["stats"]["extra"]["cfg_parallel"]
        assert record["path"] == "single_branch" and record["num_exchanges"] == 0
        assert record["reason"].startswith("guidance_scale=1.0 <= 1")
        assert out["off"]["paths"]["cfg_parallel"] == {"single_branch": 1}
        assert out["off"]["refusals"] == [f"cfg_parallel: {record['reason']}"]


def test_ranks_share_a_seed_and_refuse_different_calls(ranks):
    first, second = ranks["results"][0], ranks["results"][1]
    assert first["unseeded"]["seed"] == second["unseeded"]["seed"] is not None  # rank 0's draw, recorded
    assert np.array_equal(first["unseeded"]["frames"], second["unseeded"]["frames"])
    for out in (first, second):
        assert out["mismatch"].startswith("CFG-parallel ranks were called with different arguments")
        assert out["layout"]["cfg"][1] == 2 and out["layout"]["dp"][1] == 1


def test_cli_cfg_parallel_clip_equals_the_single_process_render(ranks, tiny_wan_dir, tmp_path):
    from metainfer_gen.apps.cli import main
    from metainfer_gen.video.export import read_video

    assert [out["cli"] for out in ranks["results"].values()] == [0, 0]
    reference = tmp_path / "single.mp4"
    assert main(["render", T2V_CALL["prompt"], "-o", str(reference), "--model", str(tiny_wan_dir), *CLI_ARGS]) == 0
    assert np.array_equal(read_video(ranks["clip"]), read_video(reference))


def test_one_process_falls_back_and_says_why(fresh_t2v, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    reference = render(fresh_t2v, T2V_CALL)
    fresh_t2v.enable_cfg_parallel()
    out = render(fresh_t2v, T2V_CALL)

    _assert_same_clip(out, reference)
    record = out["stats"]["extra"]["cfg_parallel"]
    assert (record["path"], record["group_size"], record["num_skipped_calls"]) == ("sequential", 1, 0)
    assert record["reason"].startswith("one process (WORLD_SIZE unset or 1)")
    assert out["paths"]["cfg_parallel"] == {"sequential": 1}
    assert out["refusals"] == [f"cfg_parallel: {record['reason']}"]
    assert out["stats"]["transformer_calls"] == 4
    fresh_t2v.disable_cfg_parallel()
    assert "cfg_parallel" not in render(fresh_t2v, T2V_CALL)["stats"]["extra"]


# ------------------------------------------------------------------------------------- pieces, without processes


def test_config_and_plan_refuse_what_they_cannot_do(fresh_t2v):
    from metainfer_gen.video.cfg_parallel import CfgParallelConfig, plan_cfg_parallel

    with pytest.raises(ValueError, match="group must be one of"):
        CfgParallelConfig(group="pipeline")
    with pytest.raises(TypeError, match="CfgParallelConfig"):
        fresh_t2v.enable_cfg_parallel("cfg")
    record = plan_cfg_parallel(CfgParallelConfig(), fresh_t2v.diffusers_pipeline, None)
    assert record.path == "single_branch"


def test_an_odd_world_is_refused(fresh_t2v, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="WORLD_SIZE=3 is odd"):
        fresh_t2v.enable_cfg_parallel()
    assert fresh_t2v.cfg_parallel is None


def test_fingerprint_sees_values_not_object_addresses():
    from metainfer_gen.video.rank_agreement import call_fingerprint

    image = reference_image()
    base = call_fingerprint({"prompt": "p", "image": image, "callback_on_step_end": reference_image})
    assert base == call_fingerprint({"prompt": "p", "image": image.copy(), "callback_on_step_end": reference_image})
    assert base != call_fingerprint({"prompt": "p", "image": image[::-1].copy(),
                                     "callback_on_step_end": reference_image})
    assert 0 <= base < 2**63


def test_the_hook_skips_the_other_ranks_call_and_refuses_a_mismatched_pair(fresh_t2v):
    """Rank 1's first call of a step returns an empty tensor without computing; a second call at another
    timestep is not its pair and raises before any exchange."""
    import torch
    from diffusers.hooks.hooks import HookRegistry

    from metainfer_gen.video.cfg_parallel import (CFG_PARALLEL_HOOK, CfgParallelHook, CfgParallelRecord, _Pair,
                                                  remove_cfg_parallel)

    transformer = fresh_t2v.diffusers_pipeline.transformer
    record = CfgParallelRecord("cfg_parallel", "test", rank=1, group_size=2)
    hook = CfgParallelHook(_Pair(SimpleNamespace(rank=1), record))
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(hook, CFG_PARALLEL_HOOK)
    calls = []
    handle = transformer.proj_out.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 4, 2, 8, 8), "encoder_hidden_states": torch.randn(1, 7, 64),
              "return_dict": False}
    try:
        with torch.inference_mode():
            (first,) = transformer(timestep=torch.tensor([900]), **inputs)
            assert first.numel() == 0 and calls == [] and record.num_skipped_calls == 1
            with pytest.raises(RuntimeError, match="does not call cond then uncond at one timestep"):
                transformer(timestep=torch.tensor([800]), **inputs)
        assert calls == []
    finally:
        handle.remove()
        remove_cfg_parallel(transformer)
    assert HookRegistry.check_if_exists_or_initialize(transformer).get_hook(CFG_PARALLEL_HOOK) is None
