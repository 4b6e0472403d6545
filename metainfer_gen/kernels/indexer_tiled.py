"""The lightning indexer in tiles: float32 scores one (query tile x key tile) at a time, top-k per query tile.

The reference (:func:`metainfer_gen.kernels.indexer.indexer_scores_reference`) materialises the per-head scores
(B, n, H, L) in float32 before summing the heads: 32 MB for 4 queries at 32K context with V3.2's 64 heads, 256 GB
for a whole 32K-token prefill. Here each step holds one tile of at most ``tile_elements`` per-head scores (4 MB in
float32 by default, so the ReLU and the head sum run on data still in cache) and one (q_tile, L) block of summed
scores, which is reduced to the query tile's top-k before the next tile starts. The arithmetic per score is the
reference's, in its order (matmul, scale, ReLU, head-weighted sum, all float32), and the top-k runs over rows of
the same width with the same ``-inf`` padding, so the two paths select the same keys, ties included, whenever the
matmul rounds alike (bit-identical on the embedded DSA model, where a context fits one key tile). Keys past the
last visible position of a query tile are never read, which halves the work of a causal prefill.

Keys may be cached in low precision -- bf16 in a bf16 run, float8_e4m3fn in an fp8 KV cache -- and are upcast one
key tile at a time: scores accumulate in float32, as DeepSeek-V3.2's ``fp8_index`` accumulates its fp8 products
(DeepSeek-V3.2-Exp ``inference/kernel.py``; vLLM's and SGLang's DSA indexers keep the keys in fp8 with one scale
per token). The multiply stays float32 because that is the fast GEMM on CPUs without bf16 units: on this project's
AVX2 machine (no avx512_bf16, no AMX) a bf16 matmul of the indexer's shape measured 6x to over 100x slower than
float32 (see ``docs/demo_llm.md``), so low-precision keys save bytes, not multiplies, here.
"""

from __future__ import annotations

import torch

__all__ = ["KEY_TILE", "TILE_ELEMENTS", "indexer_topk_tiled"]

KEY_TILE = 4096  # keys per tile (upper bound; fewer when the heads x query tile would not fit TILE_ELEMENTS)
TILE_ELEMENTS = 1 << 20  # per-head float32 scores held at once: 4 MB, the size that kept the GEMM at full speed


def _tiles(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(total, start + size)


def indexer_topk_tiled(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor, topk: int,
                       scale: float, *, key_tile: int = KEY_TILE, tile_elements: int = TILE_ELEMENTS) -> torch.Tensor:
    """(B, n, H, D) q, (B, n, H) weights, (B, L, D) keys (any float dtype or float8_e4m3fn), (B, n) lengths ->
    (B, n, min(topk, L)) int64 key indices, best first, ``-1`` where a query sees fewer keys.

    Memory beyond the output: ``tile_elements`` per-head scores plus q_tile x L summed scores, where q_tile =
    ``tile_elements // (H * key_tile)`` (at least 1). Same contract as
    :func:`metainfer_gen.kernels.indexer.indexer_topk_reference`.
    """
    batch, n, heads, dim = q.shape
    length = keys.shape[1]
    k = min(topk, length)
    out = torch.full((batch, n, k), -1, dtype=torch.long, device=q.device)
    if not (batch and n and length):
        return out
    key_tile = max(1, min(key_tile, length))
    q_tile = max(1, tile_elements // (heads * key_tile))
    qf, wf = q.float(), weights.float()
    for b in range(batch):
        visible_b = lengths[b].clamp(0, length)
        for q0, q1 in _tiles(n, q_tile):
            visible = visible_b[q0:q1]
            seen = int(visible.max())  # keys past this position are invisible to the whole query tile
            if seen == 0:
                continue
            rows = qf[b, q0:q1].reshape(-1, dim)  # (t * H, D)
            w = wf[b, q0:q1].unsqueeze(-2)  # (t, 1, H)
            block = torch.empty(q1 - q0, length, dtype=torch.float32, device=q.device)
            for k0, k1 in _tiles(seen, key_tile):
                tile = torch.mm(rows, keys[b, k0:k1].float().T).view(q1 - q0, heads, k1 - k0)
                tile.mul_(scale).relu_()
                block[:, k0:k1] = torch.bmm(w, tile).squeeze(1)
            # -inf past each query's keys over the full row width, so that exact ties (a score of 0 wherever every
            # head's ReLU is 0: common once fewer than top-k keys score above 0) resolve as the reference's top-k
            # over the same row resolves them.
            block[:, seen:] = float("-inf")
            block[:, :seen].masked_fill_(torch.arange(seen, device=q.device) >= visible[:, None], float("-inf"))
            picked = block.topk(k, dim=-1).indices
            out[b, q0:q1] = torch.where(picked < visible[:, None], picked, -1)
    return out
