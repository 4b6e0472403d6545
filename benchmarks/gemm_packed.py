"""The CPU's dense linears with the weight packed once for oneDNN against what the engine's prefill runs.

    OMP_NUM_THREADS=2 python benchmarks/gemm_packed.py
    OMP_NUM_THREADS=2 python benchmarks/gemm_packed.py --rows 64,480 --dtypes float32

Rows per (dtype, rows x K x N):

- ``F.linear``: what the engine's eager prefill runs (float32: MKL's sgemm; bf16: oneDNN with the plain weight);
- ``mkl-packed`` (float32 only): ``torch.ops.mkl._mkl_linear`` against an MKL-packed weight, what an Inductor
  ``freezing`` graph emits for a float32 linear on x86;
- ``onednn-packed``: ``torch.ops.mkldnn._linear_pointwise`` against ``torch.ops.mkldnn._reorder_linear_weight``
  (oneDNN's blocked layout, made once), what a ``freezing`` graph emits for bf16.

Shapes are the random-large DeepSeek-V3's linears of ``serve_llm.py`` (hidden 384, q_lora 192, latent 512 + 64,
8 heads, expert width 192, dense MLP 1,024) at row counts of decode batches (16, 64), of a prefill chunk's expert
runs (120) and of prefill chunks (480, 2,048). Each case's rows are timed in turn (rows interleaved), every round;
the fastest round counts. The operands stay hot in cache across the repeats, so this is the GEMMs' own speed: in the
engine (docs/kernels_cpu.md, "Prepacked GEMMs") the packed float32 path did not shorten a batch measurably.
The error column is the worst absolute difference from a float64 product.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table import print_table, run_footer, run_header  # noqa: E402

SHAPES = ((384, 192), (192, 1024), (384, 576), (512, 1024), (512, 384), (384, 384), (192, 384), (1024, 384))


def rows_for(x: torch.Tensor, w: torch.Tensor) -> dict:
    """The implementations for (x, w), each a zero-argument callable (weights packed here, once)."""
    m = x.shape[0]
    rows = {"F.linear": lambda: F.linear(x, w)}
    if x.dtype == torch.float32 and torch._C.has_mkl:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        rows["mkl-packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, m)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    rows["onednn-packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
    return rows


def best_s(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every (case, row) (default 3)")
    parser.add_argument("--repeats", type=int, default=10, help="calls timed per row per round (default 10)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    parser.add_argument("--rows", default="16,64,120,480,2048", help="row counts M (default 16,64,120,480,2048)")
    args = parser.parse_args(argv)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN (torch.backends.mkldnn.is_available() is False)")
    print(run_header())
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    cases = []
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for m in (int(v) for v in args.rows.split(",")):
            for k, n in SHAPES:
                x = torch.randn(m, k, generator=g).to(dtype)
                w = torch.randn(n, k, generator=g).to(dtype)
                cases.append(((dtype, m, k, n), x, w, rows_for(x, w)))
    times: dict[tuple, float] = {}
    for _ in range(args.rounds):
        for case, _, _, rows in cases:
            for name, fn in rows.items():
                times[case, name] = min(times.get((case, name), float("inf")), best_s(fn, args.repeats))
    table = []
    for case, x, w, rows in cases:
        dtype, m, k, n = case
        ref = x.double() @ w.double().t()
        base = times[case, "F.linear"]
        for name, fn in rows.items():
            s = times[case, name]
            table.append([str(dtype).removeprefix("torch."), f"{m} x {k} x {n}", name, f"{2 * m * k * n / s / 1e9:.0f}",
                          f"{base / s:.2f}x", f"{(fn().double() - ref).abs().max().item():.1e}"])
    print_table(["dtype", "M x K x N", "path", "GFLOP/s", "vs F.linear", "abs error worst"], table)
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
