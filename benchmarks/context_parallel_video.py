"""One clip on 1, 2 and 4 CPU ranks: context parallelism (CP) and CP x CFG-parallel, with and without the step cache.

    OMP_NUM_THREADS=1 python benchmarks/context_parallel_video.py               # random Wan 4x512, 17 frames 128x128
    python benchmarks/context_parallel_video.py --frames 5 --size 64 --steps 4 --layouts 1,cp2   # smoke run

The transformer dominates the clip: the step-cache benchmark's random-initialised Wan (``--layers`` blocks of
width ``--width``, heads of 64, so 8 heads that Ulysses splits 2 and 4 ways) with its tiny random VAE and the
embedded text encoder; 17 frames at 128x128 are 1,280 video tokens. Each layout is one launch of spawned ranks
(gloo, one intra-op thread each, as torchrun would start them), each rank building the same seeded model; per
layout an untimed call warms up, then the uncached clip and the cached one (``--cache``, default ``auto``) are
timed (best of ``--repeats``, seconds of the pipeline call on rank 0, every rank waiting for the slowest). PSNR
(dB) of the decoded clip against the one-process uncached clip of the same seed; identical clips count 100 dB.
Layouts: ``1`` one process; ``cfg2`` the two CFG branches on two ranks; ``cp2``, ``cp4`` the tokens over 2 / 4
ranks; ``cfg2xcp2`` both (4 ranks). On a machine with fewer cores than ranks the ranks share cores: the table is
then a correctness and overhead measurement, not a speedup claim.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYOUTS = {"1": (1, 1), "cfg2": (2, 1), "cp2": (1, 2), "cp4": (1, 4), "cfg2xcp2": (2, 2)}  # name: (cfg, cp)
PROMPT = "a red circle moving right"


def _rank(rank: int, world: int, port: int, layout: str, args: dict, out) -> None:
    """One rank of one layout: build, enable, warm up, time the uncached and the cached clip; rank 0 reports."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1", METAINFER_COLLECTIVES_TUNE="0",
                      METAINFER_COLLECTIVES_TIMEOUT="1800")
    import torch

    torch.set_num_threads(1)
    try:
        out.put((rank, _measure(layout, args)))
    except BaseException as exc:  # reported to the driver, which stops with it
        import traceback

        out.put((rank, RuntimeError(f"rank {rank} of {layout}: {exc}\n{traceback.format_exc()}")))


def _measure(layout: str, args: dict) -> dict:
    import torch.distributed as dist

    from benchmarks.step_cache import large_random_pipeline
    from metainfer_gen import collectives

    cfg, cp = LAYOUTS[layout]
    pipe = large_random_pipeline("cpu", None, args["layers"], args["width"])
    pipe.set_progress_bar_config(disable=True)
    if cfg * cp > 1:
        collectives.init_distributed(cfg_parallel_size=cfg, context_parallel_size=cp)
    if cp > 1:
        pipe.enable_context_parallel(cp, cfg_parallel=cfg > 1)
    elif cfg > 1:
        pipe.enable_cfg_parallel()
    call = {"num_frames": args["frames"], "height": args["size"], "width": args["size"],
            "num_inference_steps": args["steps"], "guidance_scale": args["guidance"], "seed": 0}

    def clip():
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        result = pipe(PROMPT, **call)
        if dist.is_initialized():
            dist.barrier()  # the clip is done when the slowest rank is
        return result, time.perf_counter() - start

    clip()  # warm-up
    rows = {}
    for name in ("off", args["cache"]):
        if name != "off":
            pipe.enable_step_cache(name)
        best = min((clip() for _ in range(args["repeats"])), key=lambda pair: pair[1])
        out, seconds = best
        cache = out.stats.cache or {}
        rows[name] = {"seconds": seconds, "frames": out.frames, "blocks": out.stats.block_evaluations,
                      "reused": cache.get("num_reused", 0), "disabled": cache.get("disabled_reason")}
    if cfg * cp > 1:
        collectives.shutdown_distributed()
    return rows


def launch(layout: str, args: dict) -> dict:
    """Run ``layout`` on its ranks (spawned, as torchrun would); rank 0's rows."""
    import torch.multiprocessing as mp

    from metainfer_gen.collectives.distributed import free_port

    cfg, cp = LAYOUTS[layout]
    world = cfg * cp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, layout, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(world))
    for p in procs:
        p.join()
    errors = [value for value in results.values() if isinstance(value, BaseException)]
    if errors:
        raise errors[0]
    return results[0]


def main(argv: list[str] | None = None) -> int:
    from rounds import clip_psnr
    from table import print_table, run_footer, run_header

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated of {', '.join(LAYOUTS)}")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--width", type=int, default=512, help="hidden size, heads of 64 (default 512: 8 heads)")
    parser.add_argument("--frames", type=int, default=17, help="num_frames, 4k+1 (default 17)")
    parser.add_argument("--size", type=int, default=128, help="height and width (default 128)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps (default 20)")
    parser.add_argument("--guidance", type=float, default=5.0, help="CFG scale (default 5: two branches per step)")
    parser.add_argument("--cache", default="auto", help="the step-cache spec of the cached rows (default auto)")
    parser.add_argument("--repeats", type=int, default=1, help="timed clips per row, the fastest counts (default 1)")
    args = parser.parse_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    if "1" not in layouts:
        layouts.insert(0, "1")  # the reference clip
    settings = {k: getattr(args, k) for k in ("layers", "width", "frames", "size", "steps", "guidance", "cache",
                                                "repeats")}
    print(run_header(), flush=True)
    start = time.perf_counter()
    measured = {name: launch(name, settings) for name in layouts}
    reference = measured["1"]["off"]
    base = reference["seconds"]
    rows = []
    for name in layouts:
        cfg, cp = LAYOUTS[name]
        for cache, row in measured[name].items():
            note = row["disabled"] or (f"{row['reused']} calls reused" if cache != "off" else "")
            rows.append([name, str(cfg * cp), str(cfg), str(cp), cache, f"{row['seconds']:.2f}",
                         f"{base / row['seconds']:.2f}x", str(row["blocks"]),
                         f"{clip_psnr(row['frames'], reference['frames']):.1f}", note])
    print(f"random Wan {args.layers}x{args.width}, {args.frames} frames {args.size}x{args.size}, {args.steps} steps, "
          f"guidance {args.guidance}, float32, stock kernels, 1 thread per rank; PSNR against the 1-process "
          "uncached clip")
    print_table(["layout", "ranks", "CFG", "CP", "cache", "s/clip", "vs 1 rank", "blocks (rank 0)", "PSNR dB",
                 "cache note"], rows)
    print(run_footer(time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
