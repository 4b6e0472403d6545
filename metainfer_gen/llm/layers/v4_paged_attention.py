"""DeepSeek-V4 attention over the engine's paged pool: a flat batch of several sequences' new tokens.

The same computation as the reference path (:class:`~metainfer_gen.llm.layers.v4_attention.V4Attention`, token-exact
with transformers' ``DeepseekV4Attention``), with the state that grows with the context (the compressed entries)
moved into the paged KV pool, addressed through each sequence's block table
(:class:`~metainfer_gen.llm.attention_metadata.AttentionMetadata`):

- compressed layers: entry ``e`` of rate ``r`` at the block holding token ``e r``, compacted to
  ``ceil(block_size / r)`` entry slots a block (slot ``(e r mod block_size) // r``); on CSA layers an entry's row
  is its ``head_dim`` values followed by its ``index_head_dim`` indexer key.

What is bounded per sequence is its :class:`~metainfer_gen.llm.layers.v4_attention.AttentionState` of the layer,
passed in by the model (:mod:`metainfer_gen.llm.models.deepseek_v4_engine` says where it lives): ``window``, the
K=V rows (``head_dim``) of its last ``sliding_window - 1`` tokens (the sliding window is those rows and the step's
new ones, positions ``max(0, p - sliding_window + 1) .. p``; rows that slide out are dropped), and the compressor's
and indexer's :class:`~metainfer_gen.llm.layers.kv_compressor.CompressorState` (pending tokens, fewer than ``r``
projected rows, and CSA's last Ca half). The projections run once over all T
tokens; the window grouping of the compressors, the indexer's top-k and the attention itself run sequence by
sequence (their key sets differ per sequence), a few query rows at a time (at most ``ROW_TILE_ELEMENTS`` scores
held), the compressed entries a tile of context at a time (:mod:`~metainfer_gen.llm.layers.v4_entries`: the
indexer's running top-k, whose ties break as one whole-row call, and HCA's online softmax), and a CSA query
attends to its top-k entries gathered from the pool rather than to every entry under a mask, so neither a prefill
chunk's peak nor a decode step's grows with the context (figures in docs/llm_deepseek_v4.md). Source:
transformers 5.24 ``DeepseekV4Attention`` and its caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metainfer_gen.llm.layers.v4_attention import AttentionState, CSACompressor, V4Attention
from metainfer_gen.llm.layers.v4_entries import EntryReader, attend_entries, top_entries

ROW_TILE_ELEMENTS = 1 << 20  # attention / indexer scores held at once per sequence: 4 MB in float32


def entry_slots_per_block(block_size: int, rate: int) -> int:
    """Compressed entries a block holds: ``ceil(block_size / rate)`` (one when ``rate >= block_size``)."""
    return -(-block_size // rate)


@dataclass(frozen=True, slots=True)
class SequenceView:
    """One sequence of the step: its rows ``rows`` of the flat batch, ``start`` tokens already cached,
    ``context_len`` tokens after the step, and where its positions live: ``slots`` (context_len,) int64 cache slot
    of every position (a prefill row: ``meta.prefill_slots``) or, for a decode row, only its block table ``table``
    (num_blocks,) int64, so a decode step holds no per-token list of its context."""

    rows: slice
    start: int
    context_len: int
    block_size: int
    slots: torch.Tensor | None = None
    table: torch.Tensor | None = None

    def slot_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions (n,) int64 (< context_len) -> their cache slots (n,) int64."""
        if self.slots is not None:
            return self.slots[positions]
        return self.table[positions // self.block_size] * self.block_size + positions % self.block_size


def sequence_views(meta) -> list[SequenceView]:
    """Per scheduled sequence of ``meta`` (in batch order), its rows and where its context lives."""
    where: dict[int, dict] = {i: {"slots": s} for i, s in zip(meta.prefill_rows, meta.prefill_slots)}
    for k, i in enumerate(meta.decode_rows):
        where[i] = {"table": meta.decode_block_tables[k]}
    offsets = meta.query_offsets
    return [SequenceView(slice(offsets[i], offsets[i + 1]), meta.starts[i], meta.context_lens[i], meta.block_size,
                         **where[i]) for i in range(len(meta.starts))]


def paged_v4_attention(attn: V4Attention, x: torch.Tensor, meta, views: list[SequenceView],
                       entries: torch.Tensor | None, states: list[AttentionState], rope: dict) -> torch.Tensor:
    """One V4 attention layer over a flat batch.

    Args:
        attn: the layer's weights (the reference module).
        x: (T, hidden) the normed attention input of every new token.
        meta: the step's :class:`~metainfer_gen.llm.attention_metadata.AttentionMetadata`.
        views: :func:`sequence_views` of ``meta``.
        entries: the layer's pool tensor (num_blocks, entry_slots_per_block, 1, head_dim [+ index_head_dim on CSA])
            on compressed layers, else None; the new entries and indexer keys are written into it.
        states: per sequence (batch order), its state of this layer (``window`` (min(start, sliding_window - 1),
            head_dim) in the pool's dtype, ``compressor``, ``indexer``), updated in place: ``window`` is replaced
            by the last rows after the step's tokens, the compressor states advance.
        rope: {"main"/"compress": (cos, sin) (T, rope_dim / 2) at the tokens' positions, "tables": the full
            {"main"/"compress": (cos, sin) (max_positions, rope_dim / 2)}}.
    Returns:
        (T, hidden) in x's dtype.
    Raises:
        RuntimeError: a sequence whose window or compressor state does not end where its cached tokens do.
    """
    cos, sin = rope[attn.rope_type]
    q, q_resid, kv = attn.project(x, cos, sin)
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
        key_pos = torch.arange(lo, view.context_len, device=x.device)
        keys = _slide(attn, state, kv[rows], view.start - lo).to(q.dtype)  # (T_i + window - 1 at most, D)
        pos, q_i, out_i = meta.positions[rows], q[rows], out[rows]
        reader = whole = None
        if comp is not None:
            reader = _compressed(attn, view, state, [p[rows] for p in projected], entries, meta.block_size,
                                 rope["tables"]["compress"])
            if reader.num_entries <= reader.tile_entries and not isinstance(comp, CSACompressor):
                whole = reader.read(0, reader.num_entries).to(q.dtype)  # HCA: every complete entry joins the keys
                keys = torch.cat([keys, whole])
        for t in _row_tiles(pos.shape[0], _width(attn, keys.shape[0], reader)):
            p = pos[t]
            visible = (key_pos[None] <= p[:, None]) & (key_pos[None] > p[:, None] - attn.window)
            if whole is not None:
                complete = torch.arange(whole.shape[0], device=p.device)[None] < ((p + 1) // comp.rate)[:, None]
                out_i[t] = attn._attend(q_i[t], keys, torch.cat([visible, complete], dim=1))
            elif reader is not None and not isinstance(comp, CSACompressor):  # HCA past one tile: merged online
                out_i[t] = attend_entries(attn, q_i[t], keys, visible, reader, p)
            elif reader is not None:  # CSA: the indexer's top-k entries of each query, gathered
                picked, valid = top_entries(comp.indexer, projected[4][rows][t], projected[5][rows][t], reader,
                                            slice(attn.head_dim, None), p, ROW_TILE_ELEMENTS)
                selected = reader.rows[reader.index(picked), :attn.head_dim].to(q.dtype)  # (R, k, D)
                out_i[t] = attn._attend(q_i[t], keys, visible, selected, valid)
            else:
                out_i[t] = attn._attend(q_i[t], keys, visible)
    return attn.project_out(out, cos, sin)


def _slide(attn: V4Attention, state: AttentionState, kv: torch.Tensor, held: int) -> torch.Tensor:
    """One sequence's sliding-window keys for its T new K=V rows ``kv`` (T, D): the ``held`` rows before them
    (the state's window) then ``kv``, (held + T, D) in the window's dtype; ``state.window`` becomes the last
    ``sliding_window - 1`` of them, copied (a view would keep this step's rows alive).

    Raises:
        RuntimeError: the state's window does not hold ``held`` rows (lost or reused).
    """
    if state.window.shape[0] != held:
        raise RuntimeError(f"window state holds {state.window.shape[0]} rows but the sequence needs {held}: its "
                           f"state was lost or reused")
    keys = torch.cat([state.window, kv.to(state.window.dtype)])
    cut = max(0, keys.shape[0] - attn.window + 1)
    state.window = keys[cut:].clone() if cut else keys  # keys is never written: the window may share it
    return keys


def _width(attn: V4Attention, num_keys: int, reader: EntryReader | None) -> int:
    """Scores one query row holds at once: heads x keys, and on compressed layers heads x a tile of entries (HCA)
    or the indexer's heads x a tile of entries (CSA)."""
    if reader is None:
        return attn.num_heads * num_keys
    tile = min(reader.num_entries, reader.tile_entries)
    if not isinstance(attn.compressor, CSACompressor):
        return attn.num_heads * (num_keys + tile)
    indexer = attn.compressor.indexer
    return max(attn.num_heads * (num_keys + indexer.topk), indexer.num_heads * tile + indexer.topk + 1)


def _row_tiles(num_rows: int, width: int):
    """Slices of at most ``ROW_TILE_ELEMENTS // width`` query rows (at least one)."""
    step = max(1, ROW_TILE_ELEMENTS // max(width, 1))
    for start in range(0, num_rows, step):
        yield slice(start, min(num_rows, start + step))


def _compressed(attn: V4Attention, view: SequenceView, state: AttentionState, projected: list[torch.Tensor],
                cache: torch.Tensor, block_size: int, tables) -> EntryReader:
    """Feed one sequence's new tokens to the layer's compressor(s), store the entries they close (on CSA with
    their indexer keys after ``head_dim``) and return a reader of every complete entry."""
    comp, comp_state, index_state = attn.compressor, state.compressor, state.indexer
    rate, head_dim = comp.rate, comp.head_dim
    pending = 0 if comp_state.kv is None else comp_state.kv.shape[0]
    if comp_state.num_entries * rate + pending != view.start:
        raise RuntimeError(f"compressor state holds {comp_state.num_entries * rate + pending} tokens but the "
                           f"sequence has {view.start} cached: its state was lost or reused")
    first = comp_state.num_entries
    new = comp.compress(projected[0], projected[1], comp_state, *tables)
    reader = EntryReader(cache.view(-1, cache.shape[-1]), view.slot_of, rate, block_size, cache.shape[1],
                         view.context_len // rate)
    index = reader.index(torch.arange(first, reader.num_entries, device=new.device))  # the new entries' rows
    reader.rows[index, :head_dim] = new.to(reader.rows.dtype)
    if isinstance(comp, CSACompressor):
        reader.rows[index, head_dim:] = comp.indexer.compress(projected[2], projected[3], index_state,
                                                              *tables).to(reader.rows.dtype)
    return reader
