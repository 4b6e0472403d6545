"""FP8 block-scaled GEMM: error against fp32 and, on a GPU, GFLOP/s against bf16, one table from one run.

    OMP_NUM_THREADS=1 python benchmarks/fp8_gemm.py          # CPU: errors and the reference's time vs fp32/bf16
    python benchmarks/fp8_gemm.py --device cuda              # GPU: plus the Triton kernel's GFLOP/s vs bf16 matmul

Per shape (M tokens, K in, N out; K and N include values that are not multiples of 128): the relative Frobenius
error of the fp8 path (activations 1x128, weights 128x128) against the unquantised fp32 product, the error of the
kernel that runs here against the fp32 reference of the same quantised operands (``fp8_block_gemm_reference``),
and times. The bf16 baseline is ``torch.matmul`` on the same device. Ratios are baseline time / fp8 time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # fp8_agreement, beside this file

from metainfer_gen import kernels  # noqa: E402
from metainfer_gen.kernels.fp8_gemm import FP8_BLOCK_GEMM, fp8_block_gemm_reference  # noqa: E402

SHAPES = [(64, 64, 64), (64, 200, 192), (64, 320, 576), (256, 7168, 1536), (256, 1536, 7168), (2048, 7168, 2112),
          (2048, 2048, 7168)]
QUICK = SHAPES[:4]


def time_ms(fn, device: str, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run(m: int, k: int, n: int, device: str, repeats: int) -> dict:
    x, w = torch.randn(m, k, device=device), torch.randn(n, k, device=device)
    w_q, w_s = kernels.quantize_fp8_weight(w)
    x_q, x_s = kernels.fp8_act_quant(x)
    impl, _ = FP8_BLOCK_GEMM.select(x_q, x_s, w_q, w_s, torch.bfloat16)
    ref = fp8_block_gemm_reference(x_q, x_s, w_q, w_s, torch.float32)
    got = impl(x_q, x_s, w_q, w_s, torch.float32)
    xb, wb = x.bfloat16(), w.bfloat16()
    fp8_ms = time_ms(lambda: impl(x_q, x_s, w_q, w_s, torch.bfloat16), device, repeats)
    bf16_ms = time_ms(lambda: xb @ wb.T, device, repeats)
    return dict(shape=(m, k, n), path=impl.name, quant_err=rel(got, x @ w.T), kernel_err=rel(got, ref),
                fp8_ms=fp8_ms, bf16_ms=bf16_ms, flops=2 * m * k * n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="only the small shapes")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement")
    parser.add_argument("--model", default=None, help="also measure FP8-vs-bf16 greedy agreement and weight bytes on "
                        "this checkpoint (e.g. metainfer_gen/assets/demo_llm; see benchmarks/fp8_agreement.py)")
    args = parser.parse_args(argv)
    rows = [run(*s, args.device, args.repeats) for s in (QUICK if args.quick else SHAPES)]
    print(f"fp8 block GEMM on {args.device} ({torch.get_num_threads()} CPU thread(s)); errors are relative Frobenius")
    print(f"{'M x K x N':>18} {'path':>7} {'err vs fp32':>12} {'err vs ref':>11} {'fp8 ms':>9} {'bf16 ms':>9} "
          f"{'fp8 GF/s':>9} {'bf16 GF/s':>10} {'ratio':>7}")
    for r in rows:
        m, k, n = r["shape"]
        print(f"{f'{m}x{k}x{n}':>18} {r['path']:>7} {r['quant_err']:>12.2e} {r['kernel_err']:>11.2e} "
              f"{r['fp8_ms']:>9.3f} {r['bf16_ms']:>9.3f} {r['flops'] / r['fp8_ms'] / 1e6:>9.1f} "
              f"{r['flops'] / r['bf16_ms'] / 1e6:>10.1f} {r['bf16_ms'] / r['fp8_ms']:>6.2f}x")
    if args.model:
        from fp8_agreement import print_agreement

        print_agreement(args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
