"""Context parallelism for one clip: on 2 and 4 CPU ranks (gloo) the clip's latents equal the single-process ones
within 1e-5, for text-to-video and image-to-video, with CFG-parallel on top (2 CFG x 2 CP), and with the step
cache every rank takes the single process's reuse decisions. Bad sizes fail before any work.

Each layout runs in one launch (:func:`tests.video.cp_workers.cp_cases`); the references are the same calls made
here, in one process, on the tiny Wan pipelines with 4 attention heads (Ulysses gives each rank whole heads).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.collectives.harness import run_ranks
from tests.video.cfg_workers import I2V_CALL, T2V_CALL, load, reference_image, render
from tests.video.cp_workers import CACHED_CALL, EXPERTS_CALL, cache_config, decisions
from tests.video.wan22 import two_expert_pipeline

ATOL = 1e-5
LAYOUTS = [(False, 2), (False, 4), (True, 2)]  # (CFG-parallel, CP size): 2, 4 and 2 x 2 ranks


@pytest.fixture(scope="module")
def single(tiny_wan_4_heads):
    """The same calls in this process, without any parallelism."""
    t2v = load("TextToVideoPipeline", str(tiny_wan_4_heads["t2v"]))
    i2v = load("ImageToVideoPipeline", str(tiny_wan_4_heads["i2v"]))
    out = {"t2v": render(t2v, T2V_CALL), "i2v": render(i2v, I2V_CALL, reference_image())}
    t2v.enable_step_cache(cache_config())
    out["cached"] = render(t2v, CACHED_CALL)
    experts = two_expert_pipeline(tiny_wan_4_heads["t2v"])
    experts.enable_step_cache(cache_config())
    out["experts"] = render(experts, EXPERTS_CALL)
    return out


@pytest.fixture(scope="module")
def launches(tiny_wan_4_heads, tmp_path_factory):
    """{layout: {rank: results}}: one launch of 2 ranks, one of 4 for both 4-rank layouts."""
    tmp = tmp_path_factory.mktemp("context_parallel")
    paths = {"t2v": str(tiny_wan_4_heads["t2v"]), "i2v": str(tiny_wan_4_heads["i2v"])}
    by_layout = {}
    prompts = tmp / "prompts.txt"
    prompts.write_text("a red circle moving right\nthe blue square moves up\na green circle moving left\n")
    for world, layouts in ((2, [LAYOUTS[0]]), (4, LAYOUTS[1:])):
        clip = str(tmp / "clip.mp4") if world == 2 else ""
        batch = {"prompts": str(prompts), "out_dir": str(tmp / "clips")} if world == 4 else {}
        # 900 s: a liveness guard for loaded machines; a launch takes seconds on an idle one.
        results = run_ranks("tests.video.cp_workers:cp_cases", tmp, world=world, timeout_s=900, layouts=layouts,
                            clip=clip, **batch, **paths)
        for layout in layouts:
            by_layout[layout] = {rank: out[layout] for rank, out in results.items()}
        if clip:
            by_layout["cli"] = ({rank: out["cli"] for rank, out in results.items()}, Path(clip))
        if batch:
            by_layout["batch"] = ({rank: out["batch"] for rank, out in results.items()}, tmp / "clips")
    return by_layout


def _assert_same_clip(got: dict, want: dict) -> None:
    np.testing.assert_allclose(got["latents"], want["latents"], atol=ATOL, rtol=0)
    assert np.abs(got["frames"].astype(int) - want["frames"]).max() <= 1


@pytest.mark.parametrize("layout", LAYOUTS, ids=["cp2", "cp4", "cfg2xcp2"])
def test_context_parallel_clip_equals_the_single_process_clip(launches, single, layout):
    cfg, size = layout
    for rank, out in launches[layout].items():
        for case in ("t2v", "cached") if cfg else ("t2v", "i2v", "cached"):
            _assert_same_clip(out[case], single[case])
        if "memo" in out:  # the embed memo under CP: still the one-process clip
            _assert_same_clip(out["memo"], single["t2v"])
        if "experts" in out:  # Wan 2.2's two experts, cached, under CP: the one-process clip and decisions
            _assert_same_clip(out["experts"], single["experts"])
            assert decisions(out["experts"]) == decisions(single["experts"])
            assert {r["model"] for r in out["experts"]["stats"]["cache"]["steps"] if not r["computed"]} == \
                {"transformer", "transformer_2"}
            record = out[case]["stats"]["extra"]["context_parallel"]
            assert (record["rank"], record["size"]) == (rank % size, size)
            assert record["num_tokens"] == 32 and record["tokens_per_rank"] == 32 // size
        assert out["layout"]["cp"] == (rank % size, size)
        if cfg:  # ranks 0, 1 compute cond, ranks 2, 3 uncond; each exchanges its prediction with its CFG partner
            assert out["layout"]["cfg"] == (rank // size, 2)
            assert out["t2v"]["stats"]["extra"]["cfg_parallel"]["path"] == "cfg_parallel"
    if cfg:  # a call without a seed: every rank of the CFG x CP grid draws the same noise and renders one clip
        unseeded = [out["unseeded"] for out in launches[layout].values()]
        assert len({clip["seed"] for clip in unseeded}) == 1
        for clip in unseeded[1:]:
            np.testing.assert_allclose(clip["latents"], unseeded[0]["latents"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["cp2", "cp4", "cfg2xcp2"])
def test_step_cache_takes_the_same_decisions_on_every_rank(launches, single, layout):
    want = decisions(single["cached"])
    assert any(not computed for _, _, computed in want)  # the config does reuse
    cfg, size = layout
    for rank, out in launches[layout].items():
        got = decisions(out["cached"])
        if cfg:  # each CFG group caches its own branch, and decides as one process does for that branch
            branch = "cond" if rank < size else "uncond"
            assert got == [d for d in want if d[1] == branch]
        else:
            assert got == want


def test_the_cli_renders_one_clip_over_two_ranks(launches):
    codes, clip = launches["cli"]
    assert codes == {0: 0, 1: 0} and clip.stat().st_size > 0


# ------------------------------------------------------------------------------------- errors, without processes


def test_context_parallel_without_torchrun_fails_at_once(fresh_t2v):
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        fresh_t2v.enable_context_parallel(2)
    with pytest.raises(ValueError, match="int >= 2"):
        fresh_t2v.enable_context_parallel(1)
    assert fresh_t2v.context_parallel is None


def test_sizes_that_do_not_split_the_heads_or_tokens_are_refused(fresh_t2v):
    from metainfer_gen.video.context_parallel import ContextParallelConfig, plan_context_parallel, \
        prepare_context_parallel

    pipe = fresh_t2v.diffusers_pipeline  # 2 heads; 5 frames at 32x32 are 32 tokens
    with pytest.raises(ValueError, match="num_attention_heads=2, not divisible by 4"):
        prepare_context_parallel(fresh_t2v.transformers, ContextParallelConfig(4))
    with pytest.raises(ValueError, match="32 tokens .* over 3 ranks"):
        plan_context_parallel(ContextParallelConfig(3), pipe, 5, 32, 32)


def test_a_batch_splits_over_data_parallel_groups_of_context_parallel_ranks(launches):
    """4 ranks, ``--context-parallel 2``: two groups of two split the prompt file; every clip once, one manifest."""
    import json

    codes, folder = launches["batch"]
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}
    records = [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3] and all(r["status"] == "ok" for r in records)
    assert all((folder / r["path"]).stat().st_size > 0 for r in records)
    assert all(r["stats"]["extra"]["context_parallel"]["size"] == 2 for r in records)


def test_the_cli_refuses_context_parallel_without_torchrun(tiny_wan_4_heads, tmp_path, capsys):
    from metainfer_gen.apps.cli import main

    code = main(["render", "a red circle", "-o", str(tmp_path / "clip.mp4"), "--model", str(tiny_wan_4_heads["t2v"]),
                 "--context-parallel", "2", "--cfg-parallel", "--device", "cpu"])
    assert code == 2 and "launch with torchrun --nproc-per-node 4" in capsys.readouterr().err
