"""Rank bodies of the context-parallel tests (run by :func:`tests.collectives.harness.run_ranks`), and the calls
they make, shared with the single-process reference in ``test_context_parallel.py``."""

from __future__ import annotations

import os

from tests.video.cfg_workers import CLI_ARGS, I2V_CALL, T2V_CALL, load, reference_image, render
from tests.video.wan22 import two_expert_pipeline

# 8 steps, so that the step cache has steps to reuse after its warm-up; a budget that reuses wherever the cap allows.
CACHED_CALL = {**T2V_CALL, "num_inference_steps": 8}
EXPERTS_CALL = {**T2V_CALL, "num_inference_steps": 12}


def cache_config():
    from metainfer_gen.video.cache import StepCacheConfig

    return StepCacheConfig(error_budget=1e3, num_warmup_steps=2, max_consecutive_reuses=2)


def decisions(rendered: dict) -> list[tuple[int, str, bool]]:
    """(step, branch, computed) of every transformer call the step cache decided."""
    return [(r["step"], r["branch"], r["computed"]) for r in rendered["stats"]["cache"]["steps"]]


def cp_cases(rank: int, world: int, args: dict) -> dict:
    """For each ``(cfg, size)`` of ``args["layouts"]``: text-to-video, image-to-video (without CFG-parallel) and
    text-to-video with the step cache, the clip split over ``size`` ranks (with ``cfg``, the two CFG branches on two
    CP groups of ``size``). The layouts share one launch: the default process group outlives each layout's
    collectives. With ``args["clip"]``, also the CLI's single clip with ``--context-parallel``; with
    ``args["prompts"]``, the CLI's batch with ``--context-parallel 2`` (data-parallel groups of 2 CP ranks)."""
    import torch
    import torch.distributed as dist

    from metainfer_gen import collectives

    os.environ["METAINFER_COLLECTIVES_TIMEOUT"] = "600"  # a loaded machine may start one rank minutes late
    dist.init_process_group("gloo")
    results = {}
    for cfg, size in args["layouts"]:
        t2v = load("TextToVideoPipeline", args["t2v"])
        t2v.enable_context_parallel(size, cfg_parallel=cfg)
        out = {"t2v": render(t2v, T2V_CALL)}
        if cfg:  # no seed, and each rank's global generator in another state: the grid must agree on one seed
            torch.manual_seed(1000 + rank)
            out["unseeded"] = render(t2v, {**T2V_CALL, "seed": None})
        if not cfg:
            i2v = load("ImageToVideoPipeline", args["i2v"])
            i2v.enable_context_parallel(size)
            out["i2v"] = render(i2v, I2V_CALL, reference_image())
        if not cfg and size == world:  # the lossless embed memo (the CLI's default) inside the CP hooks
            t2v.enable_embed_memo()
            out["memo"] = render(t2v, T2V_CALL)
            t2v.disable_embed_memo()
        t2v.enable_step_cache(cache_config())
        out["cached"] = render(t2v, CACHED_CALL)
        if not cfg and size == world:  # Wan 2.2's two experts under CP, both cached
            experts = two_expert_pipeline(args["t2v"])
            experts.enable_context_parallel(size)
            experts.enable_step_cache(cache_config())
            out["experts"] = render(experts, EXPERTS_CALL)
        out["layout"] = {name: (g.rank, g.size) for name, g in collectives.get_state().groups.items()}
        collectives.shutdown_distributed()
        results[(cfg, size)] = out
    from metainfer_gen.apps.cli import main

    if args.get("clip"):
        results["cli"] = main(["render", T2V_CALL["prompt"], "-o", args["clip"], "--model", args["t2v"],
                               "--context-parallel", str(world), *CLI_ARGS])
        collectives.shutdown_distributed()
    if args.get("prompts"):  # a batch on world / 2 data-parallel groups of 2 CP ranks
        results["batch"] = main(["render", "--prompts", args["prompts"], "--out-dir", args["out_dir"], "--model",
                                 args["t2v"], "--context-parallel", "2", *CLI_ARGS])
    dist.destroy_process_group()
    return results
