"""Where the decode-sized C++ experts (``cpp``) should hand over to the prefill-sized runs (``cpp-runs``).

    OMP_NUM_THREADS=2 python benchmarks/moe_crossover.py --dtype float32
    OMP_NUM_THREADS=2 python benchmarks/moe_crossover.py --dtype bfloat16 --tokens 128,256,320,384,512

Both kernels are called directly, past the pairs-per-expert limit each one's ``supports`` applies
(:func:`metainfer_gen.kernels.moe_cpu.max_pairs_per_expert`), on random-large's routed experts (16 of width 192,
hidden 384, top-4) with ``--layers`` layers of distinct weights per call, so the weights come from memory as in a
step of the engine. The two alternate within every repeat and the median per layer is reported, with the max abs
difference between their outputs (float32: the same sum in another order of roundings; bf16: ``cpp`` rounds once,
``cpp-runs`` per pair as the reference does) and the path the registry picks at that size.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe import SHAPES, make_layer, paired_median  # noqa: E402  (benchmarks/ is on the path when a script here runs)
from table import print_table, run_footer, run_header  # noqa: E402

from metainfer_gen.kernels import moe, moe_cpu, moe_runs_cpu  # noqa: E402


def rows_for(tokens: list[int], dtype: torch.dtype, num_layers: int, repeats: int) -> list[list[str]]:
    shape = SHAPES["random-large"]
    layers = [make_layer(shape, seed, dtype) for seed in range(num_layers)]
    rows = []
    for t in tokens:
        x = torch.randn(t, shape["hidden_size"]).to(dtype)
        with torch.inference_mode():
            calls = [(*layer.gate(x), *layer._stacked) for layer in layers]
            fns = [lambda kernel=kernel: [kernel(x, *call) for call in calls]
                   for kernel in (moe_cpu.moe_experts_cpp, moe_runs_cpu.moe_experts_runs_cpp)]
            cpp, runs = (s / num_layers for s in paired_median(fns, repeats, 1))
            diff = (moe_cpu.moe_experts_cpp(x, *calls[0]).float()
                    - moe_runs_cpu.moe_experts_runs_cpp(x, *calls[0]).float()).abs().max().item()
            picked, _ = moe.MOE_EXPERTS.select(x, *calls[0])
        pairs = t * shape["num_experts_per_tok"] / shape["n_routed_experts"]
        rows.append([str(t), f"{pairs:g}", f"{cpp * 1e6:,.0f}", f"{runs * 1e6:,.0f}", f"{cpp / runs:.2f}x",
                     f"{diff:.1e}", picked.name])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--tokens", default="16,32,64,96,128,160,192,224,256,320,384",
                        help="token counts (comma-separated)")
    parser.add_argument("--layers", type=int, default=8, help="layers of distinct weights per timed call")
    parser.add_argument("--repeats", type=int, default=15, help="alternating repeats per row (median reported)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    for name, fn in (("cpp", moe_cpu.warm_up), ("cpp-runs", moe_runs_cpu.warm_up)):
        if (reason := fn()) is not None:
            raise SystemExit(f"{name} is not built here: {reason}")
    if dtype == torch.bfloat16 and (reason := moe_cpu.moe_weights_cpp_refusal(*make_layer(
            SHAPES["random-large"], 0, dtype)._stacked)) is not None:
        raise SystemExit(f"cpp refuses bf16 here: {reason}")
    start = time.perf_counter()
    print(run_header())
    print(f"{args.dtype}, {args.layers} layers a call, limit: cpp up to "
          f"{moe_cpu.max_pairs_per_expert(dtype)} pairs an expert")
    rows = rows_for([int(t) for t in args.tokens.split(",")], dtype, args.layers, args.repeats)
    print_table(["tokens", "pairs an expert", "cpp us", "cpp-runs us", "cpp / cpp-runs time", "max abs diff",
                 "registry picks"], rows)
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
