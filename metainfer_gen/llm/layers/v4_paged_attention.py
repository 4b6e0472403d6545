"""DeepSeek-V4 attention over the engine's paged pool: a flat batch of several sequences' new tokens.

The same computation as the reference path (:class:`~metainfer_gen.llm.layers.v4_attention.V4Attention`, token-exact
with transformers' ``DeepseekV4Attention``), with its state moved into the paged KV pool, addressed through each
sequence's block table (:class:`~metainfer_gen.llm.attention_metadata.AttentionMetadata`):

- every layer: the K=V row (``head_dim``) of every token, at the token's slot (``meta.slot_mapping``); the sliding
  window reads positions ``max(0, p - sliding_window + 1) .. p`` back through the block table;
- compressed layers: entry ``e`` of rate ``r`` at the block holding token ``e r``, compacted to
  ``ceil(block_size / r)`` entry slots a block (slot ``(e r mod block_size) // r``); on CSA layers an entry's row
  is its ``head_dim`` values followed by its ``index_head_dim`` indexer key.

What does not fit a block (the compressor's pending tokens, fewer than ``r`` projected rows, and CSA's last Ca
half) is a per-sequence :class:`~metainfer_gen.llm.layers.kv_compressor.CompressorState`, passed in by the model
(:mod:`metainfer_gen.llm.models.deepseek_v4_engine` says where it lives). The projections run once over all T
tokens; the window grouping of the compressors, the indexer's top-k and the attention itself run sequence by
sequence (their key sets differ per sequence), a few query rows at a time (at most ``ROW_TILE_ELEMENTS`` scores
held; the indexer's top-k still sees each query's whole row), and a CSA query attends to its top-k entries
gathered from the pool rather than to every entry under a mask, so a prefill chunk's peak does not grow with the
context (figures in docs/llm_deepseek_v4.md). Source: transformers 5.24 ``DeepseekV4Attention`` and its caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metainfer_gen.llm.layers.kv_compressor import CompressorState
from metainfer_gen.llm.layers.v4_attention import CSACompressor, V4Attention

ROW_TILE_ELEMENTS = 1 << 20  # attention / indexer scores held at once per sequence: 4 MB in float32


def entry_slots_per_block(block_size: int, rate: int) -> int:
    """Compressed entries a block holds: ``ceil(block_size / rate)`` (one when ``rate >= block_size``)."""
    return -(-block_size // rate)


@dataclass(frozen=True, slots=True)
class SequenceView:
    """One sequence of the step: its rows ``rows`` of the flat batch, ``start`` tokens already cached,
    ``slots`` (context_len,) int64 cache slot of every position of its context."""

    rows: slice
    start: int
    slots: torch.Tensor

    @property
    def context_len(self) -> int:
        return int(self.slots.numel())


def sequence_views(meta) -> list[SequenceView]:
    """Per scheduled sequence of ``meta`` (in batch order), its rows and the slots of its whole context."""
    slots: dict[int, torch.Tensor] = dict(zip(meta.prefill_rows, meta.prefill_slots))
    if meta.decode_rows:
        decode = meta.decode_slots()
        for k, i in enumerate(meta.decode_rows):
            slots[i] = decode[k, : meta.context_lens[i]]
    offsets = meta.query_offsets
    return [SequenceView(slice(offsets[i], offsets[i + 1]), meta.starts[i], slots[i])
            for i in range(len(meta.starts))]


@dataclass(frozen=True, slots=True)
class LayerCaches:
    """One layer's pool tensors: ``window`` (num_blocks, block_size, 1, head_dim); ``entries`` (num_blocks,
    entry_slots_per_block, 1, head_dim [+ index_head_dim on CSA]) on compressed layers, else None."""

    window: torch.Tensor
    entries: torch.Tensor | None = None


def paged_v4_attention(attn: V4Attention, x: torch.Tensor, meta, views: list[SequenceView], caches: LayerCaches,
                       states: list[tuple[CompressorState, CompressorState] | None], rope: dict) -> torch.Tensor:
    """One V4 attention layer over a flat batch.

    Args:
        attn: the layer's weights (the reference module).
        x: (T, hidden) the normed attention input of every new token.
        meta: the step's :class:`~metainfer_gen.llm.attention_metadata.AttentionMetadata`.
        views: :func:`sequence_views` of ``meta``.
        caches: the layer's pool tensors; the new K=V rows, entries and indexer keys are written into them.
        states: per sequence (batch order), its (compressor, indexer) states on a compressed layer (the indexer's
            is unused on HCA), updated in place; None entries on a sliding layer.
        rope: {"main"/"compress": (cos, sin) (T, rope_dim / 2) at the tokens' positions, "tables": the full
            {"main"/"compress": (cos, sin) (max_positions, rope_dim / 2)}}.
    Returns:
        (T, hidden) in x's dtype.
    Raises:
        RuntimeError: a sequence whose compressor state does not end where its cached tokens do.
    """
    cos, sin = rope[attn.rope_type]
    q, q_resid, kv = attn.project(x, cos, sin)
    window = caches.window.view(-1, caches.window.shape[-1])
    window[meta.slot_mapping] = kv.to(window.dtype)
    comp = attn.compressor
    projected = None
    if comp is not None:
        projected = [comp.kv_proj(x), comp.gate_proj(x)]
        if isinstance(comp, CSACompressor):
            indexer = comp.indexer
            projected += [indexer.kv_proj(x), indexer.gate_proj(x), *indexer.queries(x, q_resid, *rope["compress"])]
    out = torch.empty_like(q)
    for view, state in zip(views, states):
        rows = view.rows
        lo = max(0, view.start - attn.window + 1)
        keys = window[view.slots[lo:]].to(q.dtype)  # the sliding window's K=V rows (T_i + window - 1 at most, D)
        key_pos = torch.arange(lo, view.context_len, device=x.device)
        pos, q_i, out_i = meta.positions[rows], q[rows], out[rows]
        entries = None
        if comp is not None:
            entries = _compressed(attn, view, state, [p[rows] for p in projected], caches.entries, meta.block_size,
                                  rope["tables"]["compress"])
        if isinstance(entries, torch.Tensor):  # HCA: every complete entry joins the keys
            keys = torch.cat([keys, entries])
        for t in _row_tiles(pos.shape[0], _width(attn, keys.shape[0], entries)):
            p = pos[t]
            visible = (key_pos[None] <= p[:, None]) & (key_pos[None] > p[:, None] - attn.window)
            if isinstance(entries, torch.Tensor):
                complete = torch.arange(entries.shape[0], device=p.device)[None] < ((p + 1) // comp.rate)[:, None]
                out_i[t] = attn._attend(q_i[t], keys, torch.cat([visible, complete], dim=1))
            elif entries is not None:  # CSA: the indexer's top-k entries of each query, gathered
                rows_of, index_keys, cache_rows = entries
                picked, valid = comp.indexer.top_entries(projected[4][rows][t], projected[5][rows][t], index_keys, p)
                selected = cache_rows[rows_of[picked], :attn.head_dim].to(q.dtype)  # (R, k, D)
                out_i[t] = attn._attend(q_i[t], keys, visible, selected, valid)
            else:
                out_i[t] = attn._attend(q_i[t], keys, visible)
    return attn.project_out(out, cos, sin)


def _width(attn: V4Attention, num_keys: int, entries) -> int:
    """Scores one query row holds at once: heads x keys, and on CSA the indexer's heads x every entry."""
    if entries is None or isinstance(entries, torch.Tensor):
        return attn.num_heads * num_keys
    indexer = attn.compressor.indexer
    return max(attn.num_heads * (num_keys + indexer.topk), indexer.num_heads * entries[1].shape[0])


def _row_tiles(num_rows: int, width: int):
    """Slices of at most ``ROW_TILE_ELEMENTS // width`` query rows (at least one)."""
    step = max(1, ROW_TILE_ELEMENTS // max(width, 1))
    for start in range(0, num_rows, step):
        yield slice(start, min(num_rows, start + step))


def _compressed(attn: V4Attention, view: SequenceView, state, projected: list[torch.Tensor], cache: torch.Tensor,
                block_size: int, tables):
    """Feed one sequence's new tokens to the layer's compressor(s) and store the entries they close. Returns, on
    HCA, every complete entry (W, head_dim); on CSA, what the indexer and the gather need: (the pool row of each
    complete entry (W,) int64, the entries' indexer keys (W, index_head_dim), the pool rows (slots, row width))."""
    comp, (comp_state, index_state) = attn.compressor, state
    rate, head_dim = comp.rate, comp.head_dim
    pending = 0 if comp_state.kv is None else comp_state.kv.shape[0]
    if comp_state.num_entries * rate + pending != view.start:
        raise RuntimeError(f"compressor state holds {comp_state.num_entries * rate + pending} tokens but the "
                           f"sequence has {view.start} cached: its state was lost or reused")
    first = comp_state.num_entries
    new = comp.compress(projected[0], projected[1], comp_state, *tables)
    rows = cache.view(-1, cache.shape[-1])
    num = view.context_len // rate
    slots = view.slots[: num * rate: rate]  # the slot of token e r, for every complete entry e
    index = slots // block_size * cache.shape[1] + slots % block_size // rate  # its compact entry slot
    rows[index[first:], :head_dim] = new.to(rows.dtype)
    if isinstance(comp, CSACompressor):
        rows[index[first:], head_dim:] = comp.indexer.compress(projected[2], projected[3], index_state, *tables).to(
            rows.dtype)
        return index, rows[index, head_dim:].to(new.dtype), rows
    return rows[index].to(new.dtype)
