"""DeepSeek-V4's compressed entries read from the paged pool a tile at a time, so a query's work over them does not
grow with the context.

A sequence's complete entries of one compressed layer are addressed through its block table
(:class:`EntryReader`), never gathered whole: the CSA indexer scores them ``ENTRY_TILE_TOKENS / rate`` at a time
and keeps a running top-(k + 1) per query (:func:`top_entries`), HCA attends to them a tile at a time merged by
online softmax (:func:`attend_entries`). Both take today's single call when every entry fits one tile, so short
contexts compute exactly as before.

Ties: ``torch.topk`` breaks exact ties (the indexer's scores tie at 0 where every head's ReLU is 0) in an order that
depends on the whole row it sees, so a running top-k cannot reproduce it alone. Keeping k + 1 values tells whether
the k-th score ties with one left out; only then is that query's whole row of scores (one float32 per entry, still
computed a tile at a time) handed to one ``torch.topk`` call, as transformers calls it, so the picks stay exactly
transformers'. (An entry dropped from a running top-(k + 1) scores at most the final (k + 1)-th, so when that
one is below the k-th the running picks are exactly the whole row's.) Memory per query: a tile's scores and keys,
plus in that tie case one float32 per entry.
Source: transformers 5.24 ``DeepseekV4Indexer`` (the top-k call), FlashAttention's online softmax (Dao et al. 2022).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

ENTRY_TILE_TOKENS = 8192  # context tokens whose entries one tile reads: 2048 CSA (rate 4) / 64 HCA (rate 128) entries


@dataclass(frozen=True, slots=True)
class EntryReader:
    """One sequence's complete entries of one layer in the pool.

    Attributes:
        rows: (num_blocks * slots_per_block, width) the layer's entry tensor as rows.
        slot_of: positions (n,) int64 -> their cache slots (n,) int64 (the sequence's block table).
        rate: tokens per entry; block_size: tokens per block; slots_per_block: entry slots a block.
        num_entries: entries complete after the step's tokens (entry e covers tokens e rate .. (e + 1) rate - 1).
    """

    rows: torch.Tensor
    slot_of: Callable[[torch.Tensor], torch.Tensor]
    rate: int
    block_size: int
    slots_per_block: int
    num_entries: int

    @property
    def tile_entries(self) -> int:
        return max(1, ENTRY_TILE_TOKENS // self.rate)

    def index(self, entries: torch.Tensor) -> torch.Tensor:
        """Entry ids (any shape, each < num_entries) -> their rows in :attr:`rows` (same shape): entry e lives at
        the block holding token e rate, compact slot (e rate mod block_size) // rate."""
        slots = self.slot_of(entries.flatten() * self.rate)
        return (slots // self.block_size * self.slots_per_block + slots % self.block_size // self.rate).view(
            entries.shape)

    def read(self, lo: int, hi: int, cols: slice = slice(None)) -> torch.Tensor:
        """Entries lo .. hi - 1, columns ``cols`` -> (hi - lo, len(cols)) in the pool's dtype."""
        return self.rows[self.index(torch.arange(lo, hi, device=self.rows.device)), cols]

    def tiles(self) -> Iterator[tuple[int, int]]:
        """(lo, hi) entry ranges of at most :attr:`tile_entries`, in order."""
        for lo in range(0, self.num_entries, self.tile_entries):
            yield lo, min(self.num_entries, lo + self.tile_entries)


def top_entries(indexer, q: torch.Tensor, weights: torch.Tensor, reader: EntryReader, cols: slice,
                positions: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSA indexer's picks for R queries, the entries' keys read a tile at a time.

    Args:
        indexer: the layer's :class:`~metainfer_gen.llm.layers.v4_attention.Indexer`.
        q: (R, H_i, D_i) indexer queries; weights: (R, H_i) float32 head weights.
        reader: the sequence's entries; ``cols`` selects their indexer keys (D_i values) in a pool row.
        positions: (R,) int64 the queries' positions (entry e is visible once e < (p + 1) // rate).
        budget: float32 scores a tie fallback holds at once (rows of whole-row scores are grouped under it).
    Returns:
        (picked (R, min(topk, W)) int64 entry ids, valid (R, min(topk, W)) bool), equal to
        ``indexer.top_entries`` over every entry at once (ties included).
    """
    num = reader.num_entries
    k = min(indexer.topk, num)
    if num <= reader.tile_entries:
        return indexer.top_entries(q, weights, reader.read(0, num, cols).to(q.dtype), positions)
    complete = (positions + 1) // reader.rate
    seen_by_all = int(complete.min())  # entries every query sees: no mask below it (a decode query sees all)
    vals = ids = None  # (R, k + 1) the best scores so far and their entry ids
    for lo, hi in reader.tiles():
        scores = indexer.scores(q, weights, reader.read(lo, hi, cols))  # (R, E)
        if hi > seen_by_all:
            scores = scores.masked_fill(torch.arange(lo, hi, device=q.device)[None] >= complete[:, None],
                                        float("-inf"))
        top = scores.topk(min(k + 1, hi - lo), dim=-1)
        del scores  # not alive beside the next tile's
        if vals is None:
            vals, ids = top.values, top.indices + lo
            continue
        best = torch.cat([vals, top.values], dim=1).topk(min(k + 1, vals.shape[1] + hi - lo), dim=-1)
        vals, ids = best.values, torch.cat([ids, top.indices + lo], dim=1).gather(1, best.indices)
    picked = ids[:, :k].clone()
    if num == k:  # every entry is picked: no tie to break
        return picked, picked < complete[:, None]
    tied = ((vals[:, k] == vals[:, k - 1]) & torch.isfinite(vals[:, k - 1])).nonzero().flatten().tolist()
    group = max(1, budget // (num + indexer.num_heads * reader.tile_entries))
    for start in range(0, len(tied), group):  # the k-th score ties one left out: torch.topk over the whole row
        rows = torch.tensor(tied[start:start + group], device=q.device)
        scores = torch.empty(rows.numel(), num, dtype=torch.float32, device=q.device)
        for lo, hi in reader.tiles():
            scores[:, lo:hi] = indexer.scores(q[rows], weights[rows], reader.read(lo, hi, cols))
        visible = torch.arange(num, device=q.device)[None] < complete[rows, None]
        picked[rows] = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices
    return picked, picked < complete[:, None]


def attend_entries(attn, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, reader: EntryReader,
                   positions: torch.Tensor) -> torch.Tensor:
    """HCA: q (R, N, D) over the window's keys = values (L, D) where ``visible`` (R, L), every complete entry
    (read a tile at a time, entry e visible once e < (p + 1) // rate) and the per-head sink, one softmax merged
    online in float32 (the sink takes its share of the weight and is dropped). -> (R, N, D) in q's dtype."""
    scale = attn.head_dim ** -0.5
    logits = (torch.einsum("tnd,ld->tnl", q.float(), keys.float()) * scale).masked_fill(
        ~visible[:, None], float("-inf"))
    sink = attn.sinks.float().view(1, -1).expand(q.shape[0], -1)  # (R, N)
    high = torch.maximum(logits.amax(dim=-1), sink)  # finite: the sink is
    probs = torch.exp(logits - high[..., None])
    total = probs.sum(dim=-1) + torch.exp(sink - high)
    acc = torch.einsum("tnl,ld->tnd", probs, keys.float())
    complete = (positions + 1) // reader.rate
    seen_by_all = int(complete.min())
    for lo, hi in reader.tiles():
        entries = reader.read(lo, hi).float()  # (E, D)
        logits = torch.einsum("tnd,ed->tne", q.float(), entries) * scale
        if hi > seen_by_all:
            hidden = torch.arange(lo, hi, device=q.device)[None] >= complete[:, None]  # (R, E)
            logits = logits.masked_fill(hidden[:, None], float("-inf"))
        new_high = torch.maximum(high, logits.amax(dim=-1))
        shrink = torch.exp(high - new_high)
        probs = torch.exp(logits - new_high[..., None])
        acc = acc * shrink[..., None] + torch.einsum("tne,ed->tnd", probs, entries)
        total, high = total * shrink + probs.sum(dim=-1), new_high
    return (acc / total[..., None]).to(q.dtype)
