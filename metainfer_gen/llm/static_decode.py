"""Static-shape decode steps: preallocated input buffers, a batch-size ladder and (on CUDA) one graph per shape.

nano-vllm's ``ModelRunner.capture_cudagraph`` and mini-sglang's CUDA-graph runner, in a module of its own: a
decode-only step of ``B`` sequences is padded to the next ladder size ``S >= B``; the token ids, positions, KV slots,
context lengths and block tables of all ``S`` rows are written into buffers allocated once, and the model runs on
those buffers, so every step of one shape has the same shapes and the same tensor addresses. On CUDA each shape is
captured once (lazily, on its first step) into a ``torch.cuda.CUDAGraph`` sharing one memory pool, and later steps
only refill the buffers and replay. On the CPU, or with ``enforce_eager``, the same buffers run eagerly.

Padding rows write no KV: their slot is -1, which ``kernels.store_kv_cache`` skips; they attend to one cache row
(slot 0, context length 1) so their softmax stays finite, and their hidden states are dropped. Every buffer row a
graph reads, real or padding, is rewritten before every step, so nothing from an earlier (larger) batch survives.

Attention reads the block-table and context-length buffers directly (``decode_block_tables`` /
``decode_context_lens`` of :class:`~metainfer_gen.llm.attention_metadata.AttentionMetadata`; the DSA indexer's
per-row slots are computed from them on the device). A graph cannot change its context length, so the table width
is laddered too: a step's shape is ``(S, W)`` with ``W`` the next power of two >= its longest block table (capped
at ``ceil(max_model_len / block_size)``), and attention walks and masks ``W * block_size`` positions per sequence,
at most twice the longest context instead of the whole ``max_model_len``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from metainfer_gen.llm.attention_metadata import AttentionMetadata


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """Sizes a decode batch is padded to: 1, 2, 4, 8, ... below ``max_num_seqs``, then ``max_num_seqs`` (also the
    ladder of block-table widths, up to the blocks of ``max_model_len``)."""
    sizes = [1]
    while sizes[-1] * 2 < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


@dataclass(slots=True)
class DecodeBuffers:
    """Inputs and output of the static decode step, ``S = max ladder size`` rows (int64 unless noted).

    Attributes:
        input_ids, positions, slot_mapping, context_lens: (S,); padding rows 0, 0, -1 (or the sink slot), 1.
        block_tables: (S, max_blocks), -1 past a row's blocks; padding rows read block 0.
        decode_tokens: (S,) ``arange`` (each row is one token), never changes.
        hidden: (S, hidden_size) in the model dtype, the model's output (rows past the batch are garbage).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    decode_tokens: torch.Tensor
    hidden: torch.Tensor

    @classmethod
    def allocate(cls, num_rows: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> "DecodeBuffers":
        def ints(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        return cls(input_ids=ints(num_rows), positions=ints(num_rows), slot_mapping=ints(num_rows),
                   context_lens=ints(num_rows), block_tables=ints(num_rows, max_blocks),
                   decode_tokens=torch.arange(num_rows, device=device),
                   hidden=torch.zeros(num_rows, hidden_size, dtype=dtype, device=device))

    @property
    def int_buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers a step writes (for tests that poison them)."""
        return self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.block_tables

    def fill(self, size: int, width: int, token_ids: list[int], block_tables: list[list[int]],
             context_lens: list[int], block_size: int, pad_slot: int = -1) -> None:
        """Write rows ``[0, size)`` (block-table columns ``[0, width)``): the ``B = len(token_ids)`` real rows, then
        padding rows up to ``size``.

        Built on the host and copied in one transfer per buffer, so every entry the ``(size, width)`` graph reads is
        overwritten (stale rows of an earlier, larger batch would otherwise write KV into live blocks).
        """
        num_real = len(token_ids)
        pad = size - num_real
        positions = [n - 1 for n in context_lens]
        slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(block_tables, positions)]
        table = torch.full((size, width), -1, dtype=torch.long)
        for i, blocks in enumerate(block_tables):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        table[num_real:, 0] = 0  # padding rows read slot 0 (context length 1) and write pad_slot (-1: nowhere)
        host = (token_ids + [0] * pad, positions + [0] * pad, slots + [pad_slot] * pad, context_lens + [1] * pad)
        for buffer, values in zip((self.input_ids, self.positions, self.slot_mapping, self.context_lens), host):
            buffer[:size].copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
        self.block_tables[:size, :width].copy_(table, non_blocking=True)


def decode_metadata(buffers: DecodeBuffers, size: int, width: int, block_size: int) -> AttentionMetadata:
    """Attention metadata of a ``(size, width)`` decode step, every tensor a view of or computed from ``buffers``.

    ``starts``/``context_lens`` (host lists, read only by the prefill path) are left empty: a graph would freeze them.
    """
    return rows_metadata(buffers.positions[:size], buffers.slot_mapping[:size], buffers.context_lens[:size],
                         buffers.block_tables[:size, :width], buffers.decode_tokens[:size], block_size)


def rows_metadata(positions: torch.Tensor, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                  block_tables: torch.Tensor, decode_tokens: torch.Tensor, block_size: int) -> AttentionMetadata:
    """Attention metadata of a decode-only step of ``S = len(positions)`` rows (one token each) from its tensors:
    positions, slot_mapping, context_lens, decode_tokens (S,) int64 and block_tables (S, W)."""
    size = positions.shape[0]
    return AttentionMetadata(positions=positions, slot_mapping=slot_mapping,
                             query_lens=[1] * size, starts=[], context_lens=[], query_offsets=list(range(size + 1)),
                             decode_rows=list(range(size)), decode_tokens=decode_tokens,
                             prefill_rows=[], prefill_slots=[],
                             decode_block_tables=block_tables, decode_context_lens=context_lens,
                             block_size=block_size)


class StaticDecode:
    """Runs decode-only steps on static buffers, replaying one CUDA graph per (size, width) shape when enabled.

    Args:
        model: the engine model (``forward(input_ids, meta, kv_caches)``).
        kv_caches: the runner's per-layer caches (read and written in place; graphs keep their addresses).
        max_num_seqs: largest decode batch (top of the ladder).
        max_model_len: context length; block tables get ``ceil(max_model_len / block_size)`` columns.
        block_size: tokens per KV block.
        use_cuda_graphs: capture and replay graphs (CUDA only); False runs the buffers eagerly.
        compiled: run each batch size's forward as one ``torch.compile``'d graph (the CPU's analog of CUDA
            graphs, :mod:`metainfer_gen.llm.compiled_decode`); built on the first step of each size.
        sink_slot: the cache slot padding rows write (needed by ``compiled``: a traced write has no -1 to skip);
            None: padding rows write nowhere (slot -1).
    Raises:
        ValueError: ``use_cuda_graphs`` on a non-CUDA device.
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], *, max_num_seqs: int, max_model_len: int,
                 block_size: int, use_cuda_graphs: bool, compiled: bool = False, sink_slot: int | None = None):
        param = next(model.parameters())
        if use_cuda_graphs and param.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {param.device} (set enforce_eager)")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.ladder = batch_size_ladder(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.buffers = DecodeBuffers.allocate(self.ladder[-1], self.max_blocks, model.config.hidden_size,
                                              param.dtype, param.device)
        self.use_cuda_graphs = use_cuda_graphs
        self.widths = batch_size_ladder(self.max_blocks)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        if compiled and sink_slot is None:
            raise ValueError("a compiled decode step needs a sink_slot for its padding rows")
        self.pad_slot = -1 if sink_slot is None else sink_slot
        self.compiled = None
        if compiled:
            from metainfer_gen.llm.compiled_decode import CompiledDecode

            self.compiled = CompiledDecode(self._rows_forward, len(self.ladder))
        self.num_steps = 0  # static steps run (eager or replayed), for tests and logs
        self.last_shape: tuple[int, int] | None = None

    def padded_size(self, num_seqs: int) -> int:
        """The smallest ladder size holding ``num_seqs`` rows."""
        return next(s for s in self.ladder if s >= num_seqs)

    def padded_width(self, num_blocks: int) -> int:
        """The smallest table width holding ``num_blocks`` blocks."""
        return next(w for w in self.widths if w >= num_blocks)

    def can_run(self, out) -> bool:
        """True for a step of one new token per sequence, each sampling, within the ladder and the table width (and,
        compiled, with a graph for its size: see :meth:`CompiledDecode.ready`)."""
        items = out.scheduled
        return (0 < len(items) <= self.ladder[-1]
                and all(i.num_tokens == 1 and i.sample and len(i.seq.block_table) <= self.max_blocks for i in items)
                and (self.compiled is None or self.compiled.ready(self.padded_size(len(items)))))

    def run(self, out) -> torch.Tensor:
        """Forward a decode-only step (``can_run(out)``); returns (B, hidden), row i for ``out.scheduled[i]``."""
        items = out.scheduled
        tables = [i.seq.block_table for i in items]
        shape = self.padded_size(len(items)), self.padded_width(max(len(t) for t in tables))
        self.buffers.fill(*shape, [i.seq.token_ids[i.start] for i in items], tables, [i.start + 1 for i in items],
                          self.block_size, self.pad_slot)
        if shape in self.graphs:
            self.graphs[shape].replay()
        elif self.use_cuda_graphs:
            self._capture(shape)
        else:
            self._forward(shape)
        self.num_steps += 1
        self.last_shape = shape
        return self.buffers.hidden[: len(items)]

    def _forward(self, shape: tuple[int, int]) -> None:
        buffers, size = self.buffers, shape[0]
        if self.compiled is not None:  # the whole table: the attention op trims it, so W is no graph dimension
            buffers.hidden[:size] = self.compiled(buffers.input_ids[:size], buffers.positions[:size],
                                                  buffers.slot_mapping[:size], buffers.context_lens[:size],
                                                  buffers.block_tables[:size])
            return
        meta = decode_metadata(buffers, *shape, self.block_size)
        buffers.hidden[:size] = self.model(buffers.input_ids[:size], meta, self.kv_caches)

    def _rows_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """The model on one decode row per sequence (what :class:`CompiledDecode` compiles per size)."""
        meta = rows_metadata(positions, slot_mapping, context_lens, block_tables,
                             self.buffers.decode_tokens[: input_ids.shape[0]], self.block_size)
        return self.model(input_ids, meta, self.kv_caches)

    def _capture(self, shape: tuple[int, int]) -> None:
        """Run and capture the ``(size, width)`` step. The buffers already hold this step's rows, so the eager warm-up
        run is the step itself (its KV and ``hidden`` are the step's; capture records without running). A model
        that cannot be captured (a host sync in a kernel) runs eager static steps from then on, with a warning."""
        self._forward(shape)  # warm-up outside capture: lazy kernel builds, allocator state
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(shape)
        except RuntimeError as err:
            warnings.warn(f"CUDA graph capture of the {shape} decode step failed ({err}); static decode steps "
                          f"run eagerly from now on", RuntimeWarning, stacklevel=3)
            self.use_cuda_graphs = False
            return
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[shape] = graph
