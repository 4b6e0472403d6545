"""Sparse vs dense MLA prefill attention (DeepSeek-V3.2 DSA) at long contexts, one table from one run.

    OMP_NUM_THREADS=1 python benchmarks/sparse_mla.py                   # contexts 2K, 8K, 32K; top-k 512, 2048
    python benchmarks/sparse_mla.py --queries 2 --contexts 2048,8192    # quicker

Times the attention of the last ``--queries`` prefill queries of a context (the cost per query is what grows with
the context; a full prefill multiplies it by the number of queries). Dense: absorbed MLA, each query against all
of its causal context in one matmul (the strong baseline: no gather, contiguous rows). Sparse: the registry's
``sparse_mla`` (Triton on a GPU, the torch reference here) over the top-k rows, and separately the lightning
indexer that chose them (scores over the whole context + top-k), which real deployments run in FP8. Shapes are
DeepSeek-V3.2's: 128 heads, latent row 512 + 64, indexer 64 heads x 128. Ratios are dense time / sparse time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen import kernels  # noqa: E402

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


def run(context: int, topks: list[int], num_queries: int, heads: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(context)
    rows = torch.randn(context, RANK + ROPE + INDEX_DIM, generator=g)
    q = torch.randn(num_queries, heads, RANK + ROPE, generator=g)
    iq = torch.randn(1, num_queries, INDEX_HEADS, INDEX_DIM, generator=g)
    weights = torch.randn(1, num_queries, INDEX_HEADS, generator=g)
    index_keys = rows[None, :, RANK + ROPE:]
    lengths = torch.arange(context - num_queries + 1, context + 1)
    scale = (128 + ROPE) ** -0.5
    dense_ms = time_ms(lambda: dense(q, rows, lengths, scale), repeats)
    out = []
    for topk in topks:
        picked = kernels.indexer_topk(iq, weights, index_keys, lengths[None], topk, INDEX_DIM ** -0.5)[0]
        index_ms = time_ms(lambda: kernels.indexer_topk(iq, weights, index_keys, lengths[None], topk,
                                                        INDEX_DIM ** -0.5), repeats)
        sparse_ms = time_ms(lambda: kernels.sparse_mla(q, rows, picked, RANK, scale), repeats)
        out.append(dict(context=context, topk=topk, dense=dense_ms, sparse=sparse_ms, index=index_ms))
    return out


def print_table(rows: list[dict], heads: int, num_queries: int) -> None:
    print(f"sparse vs dense MLA prefill attention, {num_queries} queries at the end of the context, {heads} heads, "
          f"{torch.get_num_threads()} thread(s), ms (median)")
    print(f"{'context':>8} {'top-k':>6} {'dense':>9} {'sparse attn':>12} {'ratio':>7} {'indexer':>9} "
          f"{'sparse+idx':>11} {'ratio':>7}")
    for r in rows:
        total = r["sparse"] + r["index"]
        print(f"{r['context']:>8} {r['topk']:>6} {r['dense']:>9.2f} {r['sparse']:>12.2f} "
              f"{r['dense'] / r['sparse']:>6.1f}x {r['index']:>9.2f} {total:>11.2f} {r['dense'] / total:>6.1f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="2048,8192,32768", help="comma-separated context lengths")
    parser.add_argument("--topks", default="512,2048", help="comma-separated index_topk values")
    parser.add_argument("--queries", type=int, default=4, help="prefill queries timed at the end of the context")
    parser.add_argument("--heads", type=int, default=128, help="attention heads (128 = DeepSeek-V3.2 at TP 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement")
    args = parser.parse_args(argv)
    topks = [int(t) for t in args.topks.split(",")]
    rows = []
    with torch.inference_mode(), kernels.audit() as report:
        for context in (int(c) for c in args.contexts.split(",")):
            rows.extend(run(context, topks, args.queries, args.heads, args.repeats))
    print_table(rows, args.heads, args.queries)
    print(report.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
