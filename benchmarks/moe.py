"""MoE layer benchmark: the per-expert loop (the engine's earlier path) vs grouped experts, in one run.

    OMP_NUM_THREADS=1 python benchmarks/moe.py                # embedded-LLM and random-large MoE shapes
    OMP_NUM_THREADS=1 python benchmarks/moe.py --quick        # fewer token counts and repeats
    OMP_NUM_THREADS=2 python benchmarks/moe.py --shapes random-large --layers 8   # weights from memory
    OMP_NUM_THREADS=2 python benchmarks/moe.py --shapes random-large --layers 8 --dtype bfloat16

For each shape and token count T (decode steps of T sequences, prefill chunks), the whole layer (router, routed
experts, shared experts) is timed with the routed experts run by the old loop over the expert modules and by the
grouped path (:func:`metainfer_gen.kernels.moe_experts`: one sort, then a padded ``bmm`` or GEMMs per expert run);
then the routed experts alone: reference, grouped (and which grouped path ran) and the C++ path that applies: the
decode-sized kernel (``cpp``, :mod:`metainfer_gen.kernels.moe_cpu`) or the prefill-sized runs (``cpp-runs``,
:mod:`metainfer_gen.kernels.moe_runs_cpu`), "refused" where neither does. Old and new alternate within each repeat and
the median is reported, so load on a shared machine hits both; the load average is printed with the table. The max
abs difference between the old and new layer is printed (float32: both compute the same sum), and the grouped and C++
experts' largest difference from the reference computed in float32 on the same (``--dtype``) inputs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen.kernels import moe, moe_cpu, moe_runs_cpu  # noqa: E402
from metainfer_gen.llm.layers.moe import MoE  # noqa: E402
from table import print_table, run_header  # noqa: E402  (benchmarks/ is on the path when a script here runs)

SHAPES = {
    "embedded": dict(hidden_size=128, moe_intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=2, topk_group=1, n_shared_experts=1),
    "random-large": dict(hidden_size=384, moe_intermediate_size=192, n_routed_experts=16, num_experts_per_tok=4,
                         n_group=4, topk_group=2, n_shared_experts=1),
}


def make_layer(shape: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(SimpleNamespace(norm_topk_prob=True, routed_scaling_factor=2.5, **shape)).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, shape["hidden_size"] ** -0.5)
        layer.gate.e_score_correction_bias.normal_(0, 0.01)
    layer.pack_experts()
    return layer.eval()


def old_forward(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer as it was: router, loop over the expert modules, shared experts."""
    weights, ids = layer.gate(x)
    routed = moe.moe_experts_loop(x, weights, ids, layer.first_expert, list(layer.experts.values()))
    return routed + layer.shared_experts(x)


def paired_median(fns: list, repeats: int, inner: int) -> list[float]:
    """Median seconds per call of each function, the functions alternating within every repeat."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[k].append((time.perf_counter() - start) / inner)
    return [statistics.median(t) for t in times]


def _max_diff(fn, x, weights, ids, stack) -> float:
    """Largest absolute difference of ``fn``'s routed-expert output from the reference loop's in float32 on the
    same inputs."""
    exact = moe.moe_experts_reference(x.float(), weights, ids, *(w.float() for w in stack))
    return (fn(x, weights, ids, *stack).float() - exact).abs().max().item()


def cpp_path(x, weights, ids, w13, w2):
    """(name, function) of the C++ routed experts that apply to these inputs, or (refusals joined, None)."""
    refusals = []
    for name, fn, supports in (("cpp", moe_cpu.moe_experts_cpp, moe_cpu.moe_experts_cpp_supports),
                               ("cpp-runs", moe_runs_cpu.moe_experts_runs_cpp,
                                moe_runs_cpu.moe_experts_runs_cpp_supports)):
        reason = supports(x, weights, ids, w13, w2)
        if reason is None:
            return name, fn
        refusals.append(f"{name}: {reason}")
    return "; ".join(refusals), None


def rows_for(name: str, shape: dict, tokens: list[int], repeats: int, num_layers: int,
             dtype: torch.dtype = torch.float32) -> list[list[str]]:
    """One row per token count; every timed call runs ``num_layers`` layers of distinct weights, one after another
    (reported per layer), so with enough layers each call reads its weights from memory, as a decode step does."""
    layers = [make_layer(shape, seed, dtype) for seed in range(num_layers)]
    rows = []
    for t in tokens:
        x = torch.randn(t, shape["hidden_size"]).to(dtype)
        with torch.inference_mode():
            routes = [layer.gate(x) for layer in layers]
            stacks = [layer._stacked for layer in layers]

            def each(fn):
                return lambda: [fn(layer, w, ids, *stack) for layer, (w, ids), stack in zip(layers, routes, stacks)]

            cpp_name, cpp_fn = cpp_path(x, *routes[0], *stacks[0])
            cpp_refusal = cpp_fn is None
            fns = [each(lambda layer, w, ids, w13, w2: old_forward(layer, x)), each(lambda layer, *_: layer(x)),
                   each(lambda layer, w, ids, w13, w2: moe.moe_experts_reference(x, w, ids, w13, w2)),
                   each(lambda layer, w, ids, w13, w2: moe.moe_experts_grouped(x, w, ids, w13, w2))]
            if not cpp_refusal:
                fns.append(each(lambda layer, w, ids, w13, w2: cpp_fn(x, w, ids, w13, w2)))
            inner = max(1, 32 // (t * num_layers))  # windows of about a millisecond: preemption hits all alike
            times = [v / num_layers for v in paired_median(fns, repeats, inner)]
            old, new, ref, grouped = times[:4]
            weights, ids = routes[0]
            err = (old_forward(layers[0], x) - layers[0](x)).abs().max().item()
            grouped_err = _max_diff(moe.moe_experts_grouped, x, weights, ids, stacks[0])
            cpp_err = "-" if cpp_refusal else f"{_max_diff(cpp_fn, x, weights, ids, stacks[0]):.1e}"
            counts = torch.bincount(ids.flatten(), minlength=stacks[0][0].shape[0])
        pairs = t * ids.shape[1]
        path = "padded" if pairs <= moe.PADDED_MAX_PAIRS and \
            stacks[0][0].shape[0] * int(counts.max()) <= moe.PADDED_MAX_WASTE * pairs else "runs"
        cpp = "refused" if cpp_refusal else f"{times[4] * 1e6:,.0f} ({cpp_name})"
        rows.append([name, str(t), f"{old * 1e6:,.0f}", f"{new * 1e6:,.0f}", f"{old / new:.2f}x",
                     f"{ref * 1e6:,.0f}", f"{grouped * 1e6:,.0f}", f"{ref / grouped:.2f}x", path, cpp,
                     "-" if cpp_refusal else f"{grouped / times[4]:.2f}x", str(int((counts == 0).sum())),
                     f"{err:.1e}", f"{grouped_err:.1e}", cpp_err])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="token counts 16 and 256, 11 repeats")
    parser.add_argument("--repeats", type=int, default=41, help="alternating repeats per row (median reported)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    parser.add_argument("--layers", type=int, default=1,
                        help="layers of distinct weights per timed call (8 random-large layers, 113 MB, outgrow a "
                             "32 MB L3: weights from memory, as in a decode step)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and tokens")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    tokens = [16, 256] if args.quick else [1, 16, 64, 256, 512, 2048]
    repeats = 11 if args.quick else args.repeats
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    rows = []
    for name in args.shapes.split(","):
        rows += rows_for(name, SHAPES[name], tokens, repeats, args.layers, dtype)
    print(run_header())
    print(f"threads={torch.get_num_threads()}, {args.dtype}, {args.layers} layer(s) a call, "
          f"load average before: {load}, "
          "after: "
          + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print_table(["shape", "T", "layer old us", "layer new us", "layer speedup", "experts ref us",
                 "experts grouped us", "experts speedup", "grouped path", "experts C++ us (path)", "C++ vs grouped",
                 "idle experts", "max abs diff", "grouped max abs diff", "C++ max abs diff"], rows)


if __name__ == "__main__":
    main()
