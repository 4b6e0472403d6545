"""How close one offline batch of the engine runs to its GEMM floor: every matmul of a profiled batch, by shape,
against the same shape timed alone on this machine.

    OMP_NUM_THREADS=2 python benchmarks/llm_roofline.py --dtype float32 --prompt-lens 512,1024 --output-len 4
    OMP_NUM_THREADS=2 python benchmarks/llm_roofline.py --dtype bfloat16               # the C=64 batch
    OMP_NUM_THREADS=2 python benchmarks/llm_roofline.py --dtype float32 --peer-ratio 1.20  # + what a target needs

The batch is ``llm_profile.py``'s (serve_llm.py's random-large DeepSeek-V3, 64 prompts, warmed up, one batch
first; the faster of the next two, unprofiled, is the batch's time). ``torch.profiler`` then records every
``aten::mm`` / ``bmm`` / ``addmm`` and oneDNN / MKL linear of a fourth batch with its input shapes, which give its
multiply-adds (a matmul called from a C++ kernel, as the routed experts' ``at::mm_out``, is recorded too).
Each distinct shape is then timed alone with the same dtype and threads: fresh operands, a preallocated output, the
median of repeats, the weight warm in cache, so the alone rate is about the best that call can reach in a batch.
The table groups shapes by kind; the lines under it give:

- the batch's wall time (unprofiled and profiled), the profiled time inside matmuls, and the rest;
- the GEMM floor: every matmul at its alone rate, all other work free;
- the ceiling with today's other work: every matmul at its alone rate, the rest as measured;
- with ``--peer-ratio R`` (ours / the peer on this load, from a ``serve_llm.py`` run), the ratio each of those two
  would give against the same peer, and the time the batch would need for ``--target`` (default 1.5x).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import add_batch_args, random_large_batches  # noqa: E402
from table import print_table, run_header  # noqa: E402

from metainfer_gen import host_allocator  # noqa: E402

MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "mkldnn::_linear_pointwise", "mkl::_mkl_linear")


def gemm_shape(name: str, shapes: list) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of one recorded matmul from its input shapes, or None where they do not say."""
    try:
        if name == "aten::mm":
            (m, k), (_, n) = shapes[0], shapes[1]
            return 1, m, k, n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return b, m, k, n
        if name == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
            return 1, m, k, n
        if name == "mkldnn::_linear_pointwise":  # (x (.., K), weight (N, K), bias (N,), ...) or, fused with a
            binary = len(shapes) > 2 and len(shapes[2]) == 2  # binary op: (x, other (.., N), weight (N, K), ...)
            x, (n, k) = shapes[0], shapes[2 if binary else 1]
            return 1, math.prod(x[:-1]), k, n
        if name == "mkl::_mkl_linear":  # (x (.., K), packed weight, original weight (N, K), bias, batch)
            x, (n, k) = shapes[0], shapes[2]
            return 1, math.prod(x[:-1]), k, n
    except (IndexError, TypeError, ValueError):
        return None
    return None


def kind(name: str, shape: tuple[int, int, int, int]) -> str:
    """The table row a matmul joins: its op, batch and K x N, M bucketed (decode-sized, small, large)."""
    b, m, k, n = shape
    rows = "M<=64" if m <= 64 else "M<=256" if m <= 256 else "M<=1024" if m <= 1024 else "M>1024"
    op = name.split("::")[1].lstrip("_")
    return f"{op} {'' if b == 1 else f'{b}x '}{rows} K{k} N{n if n < 700 else '>=700'}"


def time_alone(shape: tuple[int, int, int, int], dtype: torch.dtype, min_s: float = 0.02) -> float:
    """Median seconds of one (batch, M, K, N) matmul alone in ``dtype``: ``torch.bmm`` / ``torch.mm`` into a
    preallocated output, the second operand transposed as a linear's weight is."""
    b, m, k, n = shape
    a = torch.randn(b, m, k).to(dtype)
    w = torch.randn(b, n, k).to(dtype).transpose(1, 2)
    out = torch.empty(b, m, n, dtype=dtype)
    run = (lambda: torch.mm(a[0], w[0], out=out[0])) if b == 1 else (lambda: torch.bmm(a, w, out=out))
    run()
    times, spent = [], 0.0
    while len(times) < 5 or (spent < min_s and len(times) < 200):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_args(parser)
    parser.add_argument("--peer-ratio", type=float, default=None,
                        help="ours / peer on this load from a serve_llm.py run (offline column)")
    parser.add_argument("--target", type=float, default=1.5, help="ratio to size against (default 1.5)")
    parser.add_argument("--rows", type=int, default=20, help="table rows (kinds by time in the batch)")
    args = parser.parse_args(argv)
    if argv is None:
        host_allocator.reexec()
    print(run_header())
    pipe, params, batches = random_large_batches(args, 4)
    dtype = pipe.engine.dtype
    pipe.engine.generate(batches[0], params)
    unprofiled = []
    for batch in batches[1:3]:
        start = time.perf_counter()
        pipe.engine.generate(batch, params)
        unprofiled.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        pipe.engine.generate(batches[3], params)
        profiled = time.perf_counter() - start
    calls: dict[tuple, list] = defaultdict(lambda: [0, 0.0])  # (name, shape) -> [calls, self seconds]
    total_self = 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        total_self += event.self_cpu_time_total / 1e6
        shape = gemm_shape(event.key, event.input_shapes) if event.key in MATMULS else None
        if shape is not None:
            entry = calls[(event.key, shape)]
            entry[0] += event.count
            entry[1] += event.self_cpu_time_total / 1e6
    del pipe
    kinds: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # calls, GFLOP, batch s, alone s
    for (name, shape), (count, seconds) in calls.items():
        b, m, k, n = shape
        row = kinds[kind(name, shape)]
        row[0] += count
        row[1] += 2 * b * m * k * n * count / 1e9
        row[2] += seconds
        row[3] += time_alone(shape, dtype) * count
    report(args, dtype, kinds, min(unprofiled), profiled, total_self)


def report(args, dtype, kinds: dict, unprofiled: float, profiled: float, total_self: float) -> None:
    ordered = sorted(kinds.items(), key=lambda item: -item[1][2])
    rows = [[name, str(c), f"{g:.1f}", f"{b:.3f}", f"{g / b:.0f}", f"{g / a:.0f}", f"{a:.3f}"]
            for name, (c, g, b, a) in ordered[:args.rows]]
    print(f"\ndtype {dtype}, batch of {args.num_prompts} x {args.prompt_lens} tokens x {args.output_len}: "
          f"{unprofiled:.2f} s unprofiled (the faster of two), {profiled:.2f} s profiled ({total_self:.2f} s of ops' "
          f"self time)")
    print_table(["matmul kind", "calls", "GFLOP", "in batch s", "in batch GFLOP/s", "alone GFLOP/s", "alone s"],
                rows)
    gflop = sum(v[1] for v in kinds.values())
    in_batch = sum(v[2] for v in kinds.values())
    alone = sum(v[3] for v in kinds.values())
    other = total_self - in_batch
    scale = unprofiled / total_self  # profiled self time -> unprofiled wall seconds
    print(f"\nmatmuls: {gflop:.0f} GFLOP in {in_batch:.2f} s ({gflop / in_batch:.0f} GFLOP/s; alone "
          f"{gflop / alone:.0f} GFLOP/s); other ops {other:.2f} s ({other / total_self:.0%} of self time)")
    floor, ceiling = alone * scale, (alone + other) * scale
    print(f"unprofiled batch {unprofiled:.2f} s; GEMM floor (matmuls alone, nothing else) {floor:.2f} s "
          f"({unprofiled / floor:.2f}x faster); matmuls alone + other ops as now {ceiling:.2f} s "
          f"({unprofiled / ceiling:.2f}x faster)")
    if args.peer_ratio:
        needed = unprofiled * args.peer_ratio / args.target
        print(f"against the peer (ours / peer {args.peer_ratio:.2f}x now): GEMM floor "
              f"{args.peer_ratio * unprofiled / floor:.2f}x, matmuls alone + other ops as now "
              f"{args.peer_ratio * unprofiled / ceiling:.2f}x; {args.target:.2f}x needs the batch in "
              f"{needed:.2f} s: other ops within {max(0.0, needed - floor):.2f} s with every matmul at its alone rate")


if __name__ == "__main__":
    main()
