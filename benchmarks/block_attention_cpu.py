"""The prefill attention's softmax in C++ (``bmm-fused``) against what it replaces, with each path's error against
the float32 whole-matrix reference beside it. In bf16 the baseline is ``bmm-blocks`` (the same two oneDNN GEMMs per
block of 128 queries around the torch softmax); in float32 it is PyTorch's fused flash kernel (``flash-cpu``, what
``scaled_dot_product_attention`` runs), with ``bmm-blocks`` beside it.

    OMP_NUM_THREADS=2 python benchmarks/block_attention_cpu.py                    # bf16
    OMP_NUM_THREADS=2 python benchmarks/block_attention_cpu.py --dtype float32

Shapes are the random-large DeepSeek-V3's expanded MLA prefill at TP=1: 8 heads, query/key width 128 (64 + 64
rope), values 64; a causal chunk of 512 and of 1,024 new tokens, and 512 new tokens over 1,536 keys (a chunk after
a 1,024-token prefix). Rows interleaved, the fastest of ``--rounds`` x ``--repeats`` calls; errors are the
mean and worst absolute difference of the outputs over every element.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_mla_cpu import best_ms  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402

from metainfer_gen.kernels import block_attention as ba  # noqa: E402
from metainfer_gen.kernels.cpu_build import load_built  # noqa: E402

CASES = ((512, 512, True), (1024, 1024, True), (512, 1536, False))  # queries, keys, causal
PATHS = {torch.bfloat16: ("bmm-blocks", "bmm-fused"), torch.float32: ("flash-cpu", "bmm-blocks", "bmm-fused")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every (case, row) (default 3)")
    parser.add_argument("--repeats", type=int, default=10, help="calls timed per row per round (default 10)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="bfloat16 (baseline bmm-blocks) or float32 (baseline flash-cpu); default bfloat16")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = {name: ba.BLOCK_ATTENTION.implementation(name).fn for name in PATHS[dtype]}
    baseline = PATHS[dtype][0]
    reason = load_built("block_softmax")[1]
    if reason is not None:
        raise SystemExit(f"the C++ kernel is unavailable here: {reason}")
    print(run_header())
    print(f"dtype: {args.dtype}")
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    calls = []
    for t, s, causal in CASES:
        q, k = (torch.randn(8, n, 128, generator=g).to(dtype) for n in (t, s))
        v = torch.randn(8, s, 64, generator=g).to(dtype)
        calls.append(((q, k, v, 192 ** -0.5, None, causal), (t, s, causal)))
    times: dict[tuple, float] = {}
    for _ in range(args.rounds):
        for call, case in calls:
            for name, fn in rows.items():
                times[(case, name)] = min(times.get((case, name), float("inf")), best_ms(fn, call, args.repeats))
    table = []
    for call, case in calls:
        ref = ba.block_attention_reference(*(x.float() for x in call[:3]), *call[3:])[0]
        base = times[(case, baseline)]
        for name, fn in rows.items():
            err = (fn(*call)[0].float() - ref).abs()
            table.append([f"{case[0]} x {case[1]}{' causal' if case[2] else ''}", name, f"{times[(case, name)]:.2f}",
                          f"{base / times[(case, name)]:.2f}x", f"{err.mean().item():.1e} / {err.max().item():.1e}"])
    print_table(["queries x keys", "path", "ms per call", f"vs {baseline}", "abs error mean / worst"], table)
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
