"""Blockwise MLA prefill: one sequence's new tokens over its cached context, a group of key rows at a time.

The queries of one prefill row (n tokens at positions ``start .. start + n - 1``) attend causally to the
``start + n`` rows of the sequence's paged latent cache. The context is read in chunks of at most
:func:`~metainfer_gen.llm.attention_chunks.key_chunk` rows through the sequence's slots and joined by log-sum-exp
(:class:`~metainfer_gen.llm.layers.online_softmax.LSEMerge`), so memory per step grows with n x chunk, not with
n x context (FlashAttention's outer loop over key blocks; vLLM's chunked-context MLA prefill,
``MLACommonImpl._compute_prefill_context``, also walks the cached context in chunks and merges by log-sum-exp).

Per chunk the queries split in two: those that see every key of the chunk (unmasked, the fast case of the fused
CPU kernel) and the diagonal, which gets a causal mask. Two forms, picked per row by their multiply-adds, the
absorbed ones weighted by the measured cost factor (:func:`~metainfer_gen.llm.attention_chunks.absorbed_is_cheaper`):

- expanded: ``kv_b_proj`` turns each chunk's latents into per-head ``k_nope`` and ``v`` (built transposed); ordinary
  attention with keys ``[k_nope, k_pe]`` (PyTorch's fused CPU flash kernel where it applies). The expansion costs
  ``r x N x (dn + dv)`` per context row, paid once per chunk of queries, so it wins when n is large.
- absorbed: queries ``[q_nope @ W_UK, q_pe]`` score the 576-wide latent rows directly and the output goes through
  W_UV (as decode does): ``N x (2r + dr)`` per (query, key) pair and no expansion, so it wins for short rows (a
  prompt tail after a prefix-cache hit, the last piece of a chunked prompt).
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.sparse_attention import gather_rows
from metainfer_gen.llm.attention_chunks import absorbed_is_cheaper, key_chunk
from metainfer_gen.llm.layers.online_softmax import LSEMerge, block_attention, softmax_parts

__all__ = ["prefill_attention"]


def _chunks(start: int, num_queries: int, chunk: int):
    """Context ranges ``[first, last)`` of at most ``chunk`` rows: the cached prefix, then the new rows, split at
    ``start`` so that a chunk is either seen whole by every query or begins at its own first query's position."""
    for lo, hi in ((0, start), (start, start + num_queries)):
        for first in range(lo, hi, chunk):
            yield first, min(first + chunk, hi)


def _parts(start: int, num_queries: int, first: int, last: int):
    """Query ranges attending to context rows [first, last) (a range of :func:`_chunks`): ``(lo, hi, causal)``;
    queries below ``lo`` see none of them, queries from ``full`` on see all of them, and queries [lo, full) see
    keys first .. their own position (causal, aligned at the top left). A short unmasked tail joins the causal
    part (its rows see every key, as a top-left causal mask lets them)."""
    if first < start:  # a chunk of the cached prefix: every query sees all of it
        yield 0, num_queries, False
        return
    lo = first - start
    full = min(num_queries, max(lo, last - 1 - start))
    if num_queries - full < 16:
        full = num_queries
    if full > lo:
        yield lo, full, True
    if num_queries > full:
        yield full, num_queries, False


def prefill_attention(attn, q_nope: torch.Tensor, q_pe: torch.Tensor, cache_rows: torch.Tensor,
                      slots: torch.Tensor, start: int, chunk: int | None = None) -> torch.Tensor:
    """Causal MLA of one prefill row over its cached context, blockwise.

    Args:
        attn: the :class:`~metainfer_gen.llm.layers.mla.MLAttention` (weights, dims, scale).
        q_nope: (n, N, dn), q_pe: (n, N, dr) rotated, the row's queries in the model dtype.
        cache_rows: (num_slots, row) flat view of the layer's paged cache (the new rows already stored).
        slots: (start + n,) int64 cache slots of the sequence's tokens in position order.
        start: tokens cached before this row.
        chunk: context rows per chunk (None: :func:`~metainfer_gen.llm.attention_chunks.key_chunk`).
    Returns:
        (n, N, dv) in q_nope's dtype.
    """
    n = q_nope.shape[0]
    chunk = chunk or key_chunk(attn.num_heads, n)
    if absorbed_is_cheaper(attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, n):
        return _absorbed(attn, q_nope, q_pe, cache_rows, slots, start, chunk)
    return _expanded(attn, q_nope, q_pe, cache_rows, slots, start, chunk)


def _mask(lo: int, hi: int, first: int, last: int, device) -> torch.Tensor:
    """(hi - lo, last - first) bool: the causal part of :func:`_parts`, query lo + i sees keys first .. first + i."""
    return torch.ones(hi - lo, last - first, dtype=torch.bool, device=device).tril()


def _expanded(attn, q_nope, q_pe, cache_rows, slots, start, chunk) -> torch.Tensor:
    n, heads = q_nope.shape[:2]
    dn, dr, dv, r = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    weight = attn.kv_b_proj.weight  # (N (dn + dv), r): per head its dn key rows, then its dv value rows
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # (N, n, dn + dr)
    state = None
    for first, last in _chunks(start, n, chunk):
        c_kv = gather_rows(cache_rows[:, :r], slots[first:last]).to(q_nope.dtype)  # (s, r) contiguous
        k_pe = gather_rows(cache_rows[:, r:attn.latent_size], slots[first:last]).to(q_nope.dtype)  # (s, dr)
        # Keys and values are built transposed, (N, dn + dv, s), by one GEMM against c_kv^T (a transposed operand
        # oneDNN and MKL take as it is), so the blocks' bmm reads the keys, (N, dn + dr, s), without a transposing
        # copy of (N, s, dn + dr) per chunk.
        kv_t = torch.mm(weight, c_kv.t()).view(heads, dn + dv, -1)
        key = torch.cat([kv_t[:, :dn], k_pe.t()[None].expand(heads, -1, -1)], dim=1).transpose(1, 2)
        v = kv_t[:, dn:].transpose(1, 2)  # (N, s, dv)
        for lo, hi, causal in _parts(start, n, first, last):
            out, lse = block_attention(query[:, lo:hi], key, v, attn.softmax_scale, None, causal=causal)
            if state is None and (lo, hi, last) == (0, n, start + n):  # one chunk, one part: nothing to merge
                return out.transpose(0, 1).to(q_nope.dtype)
            state = state or LSEMerge((heads, n), dv, q_nope.device)
            state.update((slice(None), slice(lo, hi)), out, lse)
    return state.result().transpose(0, 1).to(q_nope.dtype)


def _absorbed(attn, q_nope, q_pe, cache_rows, slots, start, chunk) -> torch.Tensor:
    n, heads = q_nope.shape[:2]
    r = attn.kv_lora_rank
    query = attn._absorb_query(q_nope, q_pe)  # (n, N, r + dr)
    state = LSEMerge((n, heads), r, q_nope.device)
    for first, last in _chunks(start, n, chunk):
        context = gather_rows(cache_rows, slots[first:last])[:, : attn.latent_size].to(q_nope.dtype)  # (s, r + dr)
        for lo, hi, causal in _parts(start, n, first, last):
            scores = torch.matmul(query[lo:hi], context.t()).float() * attn.softmax_scale  # (t, N, s)
            if causal:
                scores = scores.masked_fill(~_mask(lo, hi, first, last, q_nope.device)[:, None, :], float("-inf"))
            state.update((slice(lo, hi),), *softmax_parts(scores, context[:, :r], "tns,sd->tnd"))
    return attn._unabsorb(state.result().to(q_nope.dtype))
