"""The CPU's paged MLA decode: the C++ kernel (``cpp``) against the torch path it replaces (``torch-blocks``:
gather, ``bmm``, online softmax, ``bmm``), one decode step's attention of one layer, with the error of each
against the float32 whole-context reference beside it.

    OMP_NUM_THREADS=1 python benchmarks/paged_mla_cpu.py
    OMP_NUM_THREADS=2 python benchmarks/paged_mla_cpu.py --rounds 5

Shapes are the random-large DeepSeek-V3 of ``serve_llm.py`` at TP=1: 8 heads, 512 + 64 latent, block size 16;
batches of 64 and 16 sequences with contexts of 64-544 tokens (its C=64 / C=16 rows) and one sequence of 544 and of
4,096 tokens. Each round times both rows of every case in turn (rows interleaved); the fastest round counts. The
error columns are the mean and the worst absolute difference over the output's elements against the reference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table import print_table, run_footer, run_header  # noqa: E402

from metainfer_gen.kernels import paged_mla, paged_mla_cpu  # noqa: E402

CASES = ((64, 64, 544), (16, 64, 544), (1, 544, 544), (1, 4096, 4096))  # sequences, shortest, longest context
HEADS, LATENT, ROPE, BLOCK = 8, 512, 64, 16
ROWS = {"torch-blocks": paged_mla.paged_mla_decode_blocks, "cpp": paged_mla_cpu.paged_mla_decode_cpp}


def inputs(batch: int, lo: int, hi: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = -(-hi // BLOCK)
    q = torch.randn(batch, HEADS, LATENT + ROPE, generator=g).to(dtype)
    rows = torch.randn(batch * width * BLOCK, LATENT + ROPE, generator=g).to(dtype)
    tables = torch.randperm(batch * width, generator=g).view(batch, width)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g)
    return q, rows, tables, lens, BLOCK, LATENT, (128 + ROPE) ** -0.5


def best_ms(fn, args, repeats: int) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every (case, row) (default 3)")
    parser.add_argument("--repeats", type=int, default=10, help="calls timed per row per round (default 10)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated (default bfloat16,float32)")
    args = parser.parse_args(argv)
    reason = paged_mla_cpu.warm_up()
    if reason is not None:
        raise SystemExit(f"the C++ kernel is unavailable here: {reason}")
    print(run_header())
    start = time.perf_counter()
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    cases = [(dtype, case, inputs(*case, dtype)) for dtype in dtypes for case in CASES]
    times: dict[tuple, float] = {}
    for _ in range(args.rounds):
        for dtype, case, call in cases:
            for name, fn in ROWS.items():
                key = (dtype, case, name)
                times[key] = min(times.get(key, float("inf")), best_ms(fn, call, args.repeats))
    table = []
    for dtype, case, call in cases:
        ref = paged_mla.paged_mla_decode_reference(call[0].float(), call[1].float(), *call[2:])
        errors = {name: (fn(*call).float() - ref).abs() for name, fn in ROWS.items()}
        base = times[(dtype, case, "torch-blocks")]
        batch, lo, hi = case
        for name in ROWS:
            ms = times[(dtype, case, name)]
            table.append([str(dtype).removeprefix("torch."), f"{batch} x {lo}-{hi}", name, f"{ms:.2f}",
                          f"{base / ms:.2f}x", f"{errors[name].mean().item():.1e} / {errors[name].max().item():.1e}"])
    print_table(["dtype", "sequences x context", "path", "ms per call", "vs torch-blocks",
                 "abs error mean / worst"], table)
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
