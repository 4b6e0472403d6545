"""Per-step attention metadata: where each new token's KV goes and which cached tokens each query reads.

Built once per engine step by the model runner and passed explicitly down to every attention layer (nano-vllm
keeps the same fields in a global ``utils/context.py``; an argument is easier to test and cannot leak between
steps). Every index tensor is computed here once, so the layers only gather and compute.

Token layout of a step: the new tokens of sequence 0, then of sequence 1, ...; sequence ``i`` contributes
``query_lens[i]`` tokens at positions ``starts[i] .. starts[i] + query_lens[i] - 1`` and afterwards holds
``context_lens[i] = starts[i] + query_lens[i]`` tokens in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metainfer_gen.kernels.kv_cache import compute_slot_mapping, positions_from_lengths


@dataclass(slots=True)
class AttentionMetadata:
    """Index tensors of one step (all int64 on the model's device).

    Attributes:
        positions: (T,) position of every new token.
        slot_mapping: (T,) cache slot each new token's KV is written to.
        query_lens, starts, context_lens: per sequence, Python ints.
        query_offsets: flat index of each sequence's first new token, length num_seqs + 1 (Python ints).
        decode_rows: sequences with one new token, attended in one padded batch (the absorbed MLA path).
        decode_tokens: (num_decode,) flat token index of each decode row.
        decode_block_tables: (num_decode, W) cache blocks of each decode row, -1 past its blocks (W: the blocks
            of the longest decode context).
        decode_context_lens: (num_decode,) tokens each decode row attends to.
        prefill_rows: sequences with several new tokens, attended one by one (the expanded MLA path).
        prefill_slots: per prefill row, (context_len,) cache slots of its whole context.
        block_size: tokens per cache block.
        seq_ids: per sequence, its ``Sequence.seq_id`` (empty for steps without sequences behind them: memory
            profiling, warm-up); models with per-sequence state outside the pool key it by these (DeepSeek-V4).
        deferred: the stand-in metadata a compiled prefill graph traces with (``llm/compiled_prefill.py``): only
            ``positions`` and ``slot_mapping`` are the step's; attention and the routed experts run as opaque ops
            that read the step's own metadata from :func:`~metainfer_gen.llm.graph_ops.step_context`.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    starts: list[int]
    context_lens: list[int]
    query_offsets: list[int]
    decode_rows: list[int]
    decode_tokens: torch.Tensor
    prefill_rows: list[int]
    prefill_slots: list[torch.Tensor]
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    block_size: int
    seq_ids: tuple[int, ...] = ()
    deferred: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    def decode_slots(self) -> torch.Tensor:
        """(num_decode, W * block_size) int64 cache slots of each decode row's context in position order, block 0's
        slots past its length (mask with ``decode_context_lens``). Computed on call: only the DSA indexer reads
        whole contexts; dense attention walks the block tables."""
        table = self.decode_block_tables
        offsets = torch.arange(self.block_size, device=table.device)
        return (table.clamp_min(0)[:, :, None] * self.block_size + offsets).flatten(1)

    @classmethod
    def build(cls, starts: list[int], query_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu", seq_ids: list[int] | None = None) -> "AttentionMetadata":
        """Metadata for sequences that already hold ``starts[i]`` cached tokens and add ``query_lens[i]``.

        Raises:
            ValueError: a block table too short for its sequence's tokens.
        """
        num_seqs = len(starts)
        max_blocks = max((len(t) for t in block_tables), default=0)
        table = torch.full((num_seqs, max(max_blocks, 1)), -1, dtype=torch.long)
        for i, blocks in enumerate(block_tables):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        table = table.to(device)
        start_t = torch.tensor(starts, dtype=torch.long, device=device)
        qlen_t = torch.tensor(query_lens, dtype=torch.long, device=device)
        positions, seq_idx = positions_from_lengths(start_t, qlen_t)
        slot_mapping = compute_slot_mapping(positions, seq_idx, table, block_size)
        context_lens = [s + n for s, n in zip(starts, query_lens)]

        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        prefill_rows = [i for i, n in enumerate(query_lens) if n > 1]
        offsets = [0]
        for n in query_lens:
            offsets.append(offsets[-1] + n)
        max_ctx = max((context_lens[i] for i in decode_rows), default=1)
        rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        lens = torch.tensor([context_lens[i] for i in decode_rows], dtype=torch.long, device=device)
        width = -(-max_ctx // block_size)
        # a pure decode step reads the whole table as it is (a view); a mixed one copies its decode rows
        decode_tables = table[:, :width] if len(decode_rows) == num_seqs else table[rows, :width]
        prefill_slots = []
        for i in prefill_rows:
            pos = torch.arange(context_lens[i], device=device)
            prefill_slots.append(table[i, pos // block_size] * block_size + pos % block_size)
        return cls(positions=positions, slot_mapping=slot_mapping, query_lens=list(query_lens), starts=list(starts),
                   context_lens=context_lens, query_offsets=offsets, decode_rows=decode_rows,
                   decode_tokens=torch.tensor([offsets[i] for i in decode_rows], dtype=torch.long, device=device),
                   prefill_rows=prefill_rows,
                   prefill_slots=prefill_slots, decode_block_tables=decode_tables, decode_context_lens=lens,
                   block_size=block_size, seq_ids=tuple(seq_ids or ()))
