"""All-reduce latency and bus bandwidth: metainfer_gen's shared-memory collectives vs gloo, in one table.

    OMP_NUM_THREADS=1 python benchmarks/allreduce.py                       # 2 local ranks, 4 KB .. 64 MB
    OMP_NUM_THREADS=1 python benchmarks/allreduce.py --sizes 4K,1M --all-algorithms

Each rank runs every size with our ``all_reduce`` (the algorithm it chooses, plus forced one-shot and two-shot with
``--all-algorithms``) and then with ``torch.distributed.all_reduce`` on gloo, in the same processes. Latency is
the median over ``--reps`` batches of the mean time per call within a batch (rank 0's clock; the ranks are
lock-stepped by the collective itself); the contenders' batches alternate, so load from other processes falls on
each alike, and the load average is printed with the table. Bus bandwidth follows nccl-tests:
``size / time x 2 (n - 1) / n``. Results agree with gloo's bitwise before timing (float32, 2 ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Parse "4K" / "1M" / "64MB" / "4096" into bytes."""
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    """bytes -> "4 KB", "64 MB" (exact units only)."""
    for unit, k in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= k and nbytes % k == 0:
            return f"{nbytes // k} {unit}"
    return f"{nbytes} B"


def _inner_count(fn, reps: int, budget_s: float) -> int:
    """Calls per timed batch so that ``reps`` batches take about ``budget_s``; every rank uses rank 0's count."""
    import torch
    import torch.distributed as dist

    fn()  # warm-up
    start = time.perf_counter()
    fn()
    one = max(time.perf_counter() - start, 1e-6)
    agreed = torch.tensor([max(1, min(200, int(budget_s / reps / one)))])
    dist.broadcast(agreed, 0)
    return int(agreed)


def _interleaved_us(fns: dict, reps: int, budget_s: float) -> dict:
    """Median (over ``reps``) of the mean time per call, in us, for each of ``fns``; their batches alternate, so
    that load from other processes on the machine falls on every contender alike."""
    inner = {name: _inner_count(fn, reps, budget_s / len(fns)) for name, fn in fns.items()}
    batches: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            batches[name].append((time.perf_counter() - start) / inner[name] * 1e6)
    return {name: statistics.median(v) for name, v in batches.items()}


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from metainfer_gen import collectives

    torch.set_num_threads(1)
    state = collectives.init_distributed()
    rows = []
    for nbytes in args.sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        ours, ref = x.clone(), x.clone()
        collectives.all_reduce(ours)
        dist.all_reduce(ref)
        if not torch.equal(ours, ref):
            raise SystemExit(f"rank {rank}: results differ from gloo at {nbytes} B")
        chosen = collectives.last_audit().path
        y = x.clone()
        fns = {"ours": lambda: collectives.all_reduce(y)}
        if args.all_algorithms:
            for algo in ("one_shot", "two_shot"):
                fns[algo] = lambda a=algo: collectives.all_reduce(y, algorithm=a)
        fns["gloo"] = lambda: dist.all_reduce(y)
        timings = _interleaved_us(fns, args.reps, args.budget)
        rows.append((nbytes, chosen, timings))
    if rank == 0:
        th = state.groups["world"].thresholds
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        print(f"all-reduce, {world} ranks, float32, CPU ({os.cpu_count()} cores, load average {load}), "
              f"thresholds: {th.describe()}")
        extra = "".join(f" | {a} us" for a in ("one_shot", "two_shot") if args.all_algorithms)
        print(f"| size | algorithm (ours) | ours us | gloo us | speedup vs gloo | ours busbw GB/s | "
              f"gloo busbw GB/s{extra} |")
        print("|---|---|---:|---:|---:|---:|---:" + "|---:" * (2 if args.all_algorithms else 0) + "|")
        factor = 2 * (world - 1) / world
        for nbytes, chosen, t in rows:
            bw = {k: nbytes / (v * 1e-6) * factor / 1e9 for k, v in t.items()}
            cells = "".join(f" | {t[a]:.1f}" for a in ("one_shot", "two_shot") if a in t)
            print(f"| {human(nbytes)} | {chosen} | {t['ours']:.1f} | {t['gloo']:.1f} | {t['gloo'] / t['ours']:.2f}x "
                  f"| {bw['ours']:.2f} | {bw['gloo']:.2f}{cells} |")
    collectives.shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    """Spawn the ranks and print the table (rank 0)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="local ranks")
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="comma-separated message sizes (K/M suffixes)")
    parser.add_argument("--reps", type=int, default=7, help="timed batches per measurement (median reported)")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per size, roughly")
    parser.add_argument("--all-algorithms", action="store_true", help="also time forced one-shot and two-shot")
    args = parser.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    if any(s % 4 or s <= 0 for s in args.sizes):
        parser.error("sizes must be positive multiples of 4 bytes (float32)")
    import torch.multiprocessing as mp

    from metainfer_gen.collectives.distributed import free_port

    mp.spawn(_worker, args=(args.world_size, free_port(), args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
