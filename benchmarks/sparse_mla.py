"""Sparse vs dense MLA prefill attention (DeepSeek-V3.2 DSA) at long contexts, one table from one run.

    OMP_NUM_THREADS=1 python benchmarks/sparse_mla.py                   # contexts 2K, 8K, 32K; top-k 512, 2048
    python benchmarks/sparse_mla.py --queries 2 --contexts 2048,8192    # quicker

Times the attention of the last ``--queries`` prefill queries of a context (the cost per query is what grows with
the context; a full prefill multiplies it by the number of queries). Dense: absorbed MLA, each query against all
of its causal context in one matmul (the strong baseline: no gather, contiguous rows). Sparse: the registry's
``sparse_mla`` (Triton on a GPU, the torch reference here) over the top-k rows, and separately the lightning
indexer that chose them (scores over the whole context + top-k): the float32 reference, and the registry's path
(Triton on a GPU, the tiled float32 path here), with the fraction of the reference's selected keys it also
selected. Shapes are DeepSeek-V3.2's: 128 heads, latent row 512 + 64, indexer 64 heads x 128. Ratios are dense
time / (sparse attention + the registry's indexer). A second table scores indexer keys cached in bf16 and fp8
(e4m3, scale 1, as the engine's fp8 KV cache holds them): time and overlap with the float32 selection.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen import kernels  # noqa: E402
from metainfer_gen.kernels.indexer import INDEXER_TOPK, topk_overlap  # noqa: E402

RANK, ROPE, INDEX_HEADS, INDEX_DIM = 512, 64, 64, 128


def time_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def dense(q: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q (Q, N, 576), rows (L, >= 576): causal softmax attention over the first lengths[i] rows."""
    keys = rows[:, : q.shape[-1]]
    scores = torch.matmul(q, keys.T).float() * scale  # (Q, N, L)
    visible = torch.arange(rows.shape[0]) < lengths[:, None]
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    return torch.matmul(probs, rows[:, :RANK])


def run(context: int, topks: list[int], num_queries: int, heads: int, repeats: int) -> tuple[list[dict], list[dict]]:
    g = torch.Generator().manual_seed(context)
    rows = torch.randn(context, RANK + ROPE + INDEX_DIM, generator=g)
    q = torch.randn(num_queries, heads, RANK + ROPE, generator=g)
    iq = torch.randn(1, num_queries, INDEX_HEADS, INDEX_DIM, generator=g)
    weights = torch.randn(1, num_queries, INDEX_HEADS, generator=g)
    index_keys = rows[None, :, RANK + ROPE:]
    lengths = torch.arange(context - num_queries + 1, context + 1)[None]
    scale, index_scale = (128 + ROPE) ** -0.5, INDEX_DIM ** -0.5
    reference = INDEXER_TOPK.reference
    dense_ms = time_ms(lambda: dense(q, rows, lengths[0], scale), repeats)
    out, formats = [], []
    for topk in topks:
        want = reference(iq, weights, index_keys, lengths, topk, index_scale)
        picked = kernels.indexer_topk(iq, weights, index_keys, lengths, topk, index_scale)
        ref_ms = time_ms(lambda: reference(iq, weights, index_keys, lengths, topk, index_scale), repeats)
        index_ms = time_ms(lambda: kernels.indexer_topk(iq, weights, index_keys, lengths, topk, index_scale), repeats)
        sparse_ms = time_ms(lambda: kernels.sparse_mla(q, rows, picked[0], RANK, scale), repeats)
        out.append(dict(context=context, topk=topk, dense=dense_ms, sparse=sparse_ms, ref_index=ref_ms,
                        index=index_ms, overlap=topk_overlap(picked, want)))
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            keys = index_keys.to(dtype)  # as a bf16 / fp8 cache holds them
            got = kernels.indexer_topk(iq, weights, keys, lengths, topk, index_scale)
            ms = time_ms(lambda: kernels.indexer_topk(iq, weights, keys, lengths, topk, index_scale), repeats)
            formats.append(dict(context=context, topk=topk, keys=str(dtype).removeprefix("torch."), index=ms,
                                overlap=topk_overlap(got, want)))
    return out, formats


def print_table(rows: list[dict], formats: list[dict], heads: int, num_queries: int) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"sparse vs dense MLA prefill attention, {num_queries} queries at the end of the context, {heads} heads, "
          f"{torch.get_num_threads()} thread(s), ms (median); load average {load} on {os.cpu_count()} CPUs")
    print(f"{'context':>8} {'top-k':>6} {'dense':>9} {'sparse attn':>12} {'ratio':>7} {'idx fp32 ref':>13} "
          f"{'indexer':>9} {'overlap':>8} {'sparse+idx':>11} {'ratio':>7}")
    for r in rows:
        total = r["sparse"] + r["index"]
        print(f"{r['context']:>8} {r['topk']:>6} {r['dense']:>9.2f} {r['sparse']:>12.2f} "
              f"{r['dense'] / r['sparse']:>6.1f}x {r['ref_index']:>13.2f} {r['index']:>9.2f} {r['overlap']:>8.4f} "
              f"{total:>11.2f} {r['dense'] / total:>6.1f}x")
    print("indexer keys cached in low precision (scored in float32): time and overlap with the float32 selection")
    print(f"{'context':>8} {'top-k':>6} {'keys':>14} {'indexer':>9} {'overlap':>8}")
    for r in formats:
        print(f"{r['context']:>8} {r['topk']:>6} {r['keys']:>14} {r['index']:>9.2f} {r['overlap']:>8.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="2048,8192,32768", help="comma-separated context lengths")
    parser.add_argument("--topks", default="512,2048", help="comma-separated index_topk values")
    parser.add_argument("--queries", type=int, default=4, help="prefill queries timed at the end of the context")
    parser.add_argument("--heads", type=int, default=128, help="attention heads (128 = DeepSeek-V3.2 at TP 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement")
    args = parser.parse_args(argv)
    topks = [int(t) for t in args.topks.split(",")]
    rows, formats = [], []
    with torch.inference_mode(), kernels.audit() as report:
        for context in (int(c) for c in args.contexts.split(",")):
            table, by_format = run(context, topks, args.queries, args.heads, args.repeats)
            rows.extend(table)
            formats.extend(by_format)
    print_table(rows, formats, args.heads, args.queries)
    print(report.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
