"""DeepSeek-V4 for the engine: flat token batches of many sequences, attention state in the paged KV pool.

The layers are the reference path's (:mod:`metainfer_gen.llm.models.deepseek_v4`, parameter names as transformers
holds them); the embedding, hyper-connections, MoE, projections and head run once over all T new tokens of a step,
attention through :func:`~metainfer_gen.llm.layers.v4_paged_attention.paged_v4_attention`.

Cache layout (:meth:`DeepseekV4ForCausalLM.cache_layout`, what the runner allocates and ``kv_sizing`` counts): on
each compressed layer one entry tensor (num_blocks, ceil(block_size / rate), 1, head_dim [+ index_head_dim on
CSA]); sliding layers have none. Only what a sequence keeps for its whole length is paged.

What is bounded per sequence lives in a per-sequence side table (:class:`SequenceStates`), not in the pool: each
layer's last ``sliding_window - 1`` K=V rows (the window, a fixed-size tail: rows that slide out are dropped, so it
does not grow with the context) and the compressor buffers (the fewer than ``rate`` projected tokens of the open
window, CSA's last Ca half). A pool tensor pays its row in every block, so a paged copy would cost each block what
a sequence needs once (the window rows would stay in blocks the entries of their tokens keep alive).
The table is keyed by ``seq_id`` (``AttentionMetadata.seq_ids``); a sequence at position 0 starts fresh (a preempted
sequence is recomputed from 0), the runner frees an entry when its sequence finishes, aborts or is preempted; a
step's updates are kept only once its forward completes, with the state it started from, so a step run again
(``step_recovery`` reruns a failed step's sequences, even after their forward completed) starts from the same state
(so a sequence holds up to two windows between steps: the one its last step started from, and its own).
Under tensor parallelism every rank keeps its own table: every rank runs the same steps over the same tokens, and
the compressors are replicated, so the tables stay alike without any exchange. Prefix caching is off for V4
(``prefix_caching_refusal``): an entry and the compressor state at a block boundary depend on tokens of both blocks,
so blocks are not reusable alone yet.

Source: transformers 5.24 ``modeling_deepseek_v4.py`` (``DeepseekV4ForCausalLM``, the correctness reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from metainfer_gen.kernels.audit_log import record
from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.layers.kv_compressor import CompressorState, KVCompressor
from metainfer_gen.llm.layers.v4_attention import AttentionState, CSACompressor, V4Attention
from metainfer_gen.llm.layers.v4_paged_attention import entry_slots_per_block, paged_v4_attention, sequence_views
from metainfer_gen.llm.models.deepseek_v4 import V4CausalLM, V4RotaryTables
from metainfer_gen.llm.models.families import AUDIT_OP, AUDIT_SITE, FAMILIES, attention_path

# One sequence's state of one layer outside the pool: ``window`` (min(tokens, sliding_window - 1), head_dim), the
# compressor's and (CSA) indexer's CompressorState; its ``entries`` / ``index_keys`` stay None (they are paged).
LayerState = AttentionState


def _clone_compressor(state: CompressorState) -> CompressorState:
    """A copy that the compressor can update without touching ``state`` (it reassigns, never writes in place)."""
    copy = CompressorState()
    copy.kv, copy.gate, copy.prior_kv, copy.prior_gate = state.kv, state.gate, state.prior_kv, state.prior_gate
    copy.num_entries = state.num_entries
    return copy


def _layer_state(window: torch.Tensor, compressor: CompressorState, indexer: CompressorState) -> LayerState:
    state = AttentionState()
    state.window, state.compressor, state.indexer = window, compressor, indexer
    return state


def _clone(state: LayerState) -> LayerState:
    """A copy the step can update without touching ``state`` (the window tensor is reassigned, never written)."""
    return _layer_state(state.window, _clone_compressor(state.compressor), _clone_compressor(state.indexer))


def _scratch(comp: KVCompressor | None, start: int, like: torch.Tensor) -> CompressorState:
    """Zero buffers of the shapes a sequence holds after ``start`` tokens (memory profiling and warm-up run steps
    at any position without a sequence behind them); empty where ``comp`` is None."""
    state = CompressorState()
    if comp is not None and start:
        width = comp.kv_proj.weight.shape[0]
        state.kv = state.gate = like.new_zeros(start % comp.rate, width)
        if comp.overlap and start >= comp.rate:
            state.prior_kv = state.prior_gate = like.new_zeros(comp.rate, comp.head_dim)
        state.num_entries = start // comp.rate
    return state


@dataclass(slots=True)
class _Held:
    """A sequence's buffers after its last step (``start`` .. ``end`` tokens), and those it started from, so the
    same step run again (``step_recovery`` reruns a failed step's sequences) starts from the same state."""

    start: int
    end: int
    before: list[LayerState] | None
    after: list[LayerState]


class SequenceStates:
    """The side table: every running sequence's window rows and compressor buffers, per layer, by ``seq_id``
    (plain dict, no device work).

    ``begin`` hands out copies for one step, ``commit`` keeps them once the step's forward has completed.
    """

    def __init__(self, attentions: list[V4Attention]):
        self.attentions = attentions
        self._states: dict[int, _Held] = {}
        self._bases: list[list[LayerState] | None] = []

    def __len__(self) -> int:
        return len(self._states)

    def _fresh(self, start: int, like: torch.Tensor) -> list[LayerState]:
        out = []
        for attn in self.attentions:
            comp = attn.compressor
            index = comp.indexer if isinstance(comp, CSACompressor) else None
            window = like.new_zeros(min(start, attn.window - 1), attn.head_dim)
            out.append(_layer_state(window, _scratch(comp, start, like), _scratch(index, start, like)))
        return out

    def begin(self, meta: AttentionMetadata, like: torch.Tensor) -> list[list[LayerState]]:
        """Per sequence of the step (batch order), per layer, the states to update.

        Raises:
            RuntimeError: a sequence past position 0 whose state is not held (freed, or never started).
        """
        if not meta.seq_ids:  # a step without sequences behind it (profiling, warm-up): scratch state
            return [self._fresh(start, like) for start in meta.starts]
        self._bases = []
        for seq_id, start in zip(meta.seq_ids, meta.starts):
            held = self._states.get(seq_id)
            if start == 0:
                self._bases.append(None)
            elif held is not None and held.end == start:
                self._bases.append(held.after)
            elif held is not None and held.start == start and held.before is not None:  # the same step again
                self._bases.append(held.before)
            else:
                raise RuntimeError(f"sequence {seq_id} resumes at position {start} but its compressor state was "
                                   f"freed; it must restart from position 0")
        return [self._fresh(0, like) if base is None else
                [_clone(s) for s in base] for base in self._bases]

    def commit(self, meta: AttentionMetadata, staged: list[list[LayerState]]) -> None:
        """Keep ``staged`` (from :meth:`begin` of the same ``meta``, its forward completed)."""
        for seq_id, start, num, base, states in zip(meta.seq_ids, meta.starts, meta.query_lens, self._bases,
                                                    staged):
            self._states[seq_id] = _Held(start, start + num, base, states)
        self._bases = []

    def release(self, seq_id: int) -> None:
        """Forget a sequence's window rows and buffers (finished, aborted or preempted)."""
        self._states.pop(seq_id, None)


class DeepseekV4ForCausalLM(V4CausalLM):
    """The engine's DeepSeek-V4 (``config``: a transformers ``DeepseekV4Config``; ``max_positions``: the engine's
    ``max_model_len``; ``tp``: this rank's place under tensor parallelism, None for one process; see
    :class:`~metainfer_gen.llm.models.deepseek_v4.V4CausalLM`). The pool and the side table are replicated over the
    ranks (one K=V head and per-token entries, which every head reads)."""

    static_decode_refusal = FAMILIES["deepseek_v4"].refuses["compiled_decode"]
    prefix_caching_refusal = FAMILIES["deepseek_v4"].refuses["prefix_caching"]

    def __init__(self, config, max_positions: int, tp=None):
        super().__init__(config, max_positions, tp)
        self.attention_path = attention_path(config)
        attentions = [layer.self_attn for layer in self.model.layers]
        self.states = SequenceStates(attentions)
        self._cache_index, count = [], 0  # per layer, its entry tensor's place in kv_caches (None: sliding)
        for attn in attentions:
            self._cache_index.append(None if attn.compressor is None else count)
            count += attn.compressor is not None

    def cache_layout(self, block_size: int) -> list[tuple[int, int]]:
        """(slots per block, values per slot) of each pool tensor: a compressed layer's entries (ceil(block_size /
        rate), head_dim [+ index_head_dim]), layer by layer; window rows are per sequence (:class:`SequenceStates`)."""
        layout = []
        for layer in self.model.layers:
            attn = layer.self_attn
            comp = attn.compressor
            if comp is not None:
                extra = comp.indexer.head_dim if isinstance(comp, CSACompressor) else 0
                layout.append((entry_slots_per_block(block_size, comp.rate), attn.head_dim + extra))
        return layout

    def build_rotary(self, device: torch.device) -> None:
        """(Re)compute the rope tables on ``device`` (after a load on the meta device)."""
        self.rotary = V4RotaryTables(self.config, self.max_positions)
        self.rotary.tables = {k: tuple(t.to(device) for t in v) for k, v in self.rotary.tables.items()}

    def release_sequence(self, seq_id: int) -> None:
        """Free a sequence's window rows and compressor buffers (the runner calls it when the sequence ends or is
        preempted)."""
        self.states.release(seq_id)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]
                ) -> torch.Tensor:
        """input_ids (T,) int64 -> hidden states (T, hidden); writes the new entries and indexer keys into
        ``kv_caches`` (the tensors of :meth:`cache_layout`, in order).

        Raises:
            RuntimeError: a sequence resuming without its state (see :class:`SequenceStates`).
        """
        if not torch.compiler.is_compiling():
            record(AUDIT_OP, AUDIT_SITE, self.attention_path)
        x = self.model.embed_tokens(input_ids)
        staged = self.states.begin(meta, x)
        tables = self.rotary.tables
        rope = {kind: tuple(t[meta.positions] for t in tables[kind]) for kind in ("main", "compress")}
        rope["tables"] = tables
        views = sequence_views(meta)
        streams = x.unsqueeze(1).expand(-1, self.model.hc_mult, -1).contiguous()  # (T, hc_mult, hidden)
        for i, layer in enumerate(self.model.layers):
            entries = None if self._cache_index[i] is None else kv_caches[self._cache_index[i]]
            attend = partial(paged_v4_attention, layer.self_attn, meta=meta, views=views, entries=entries,
                             states=[s[i] for s in staged], rope=rope)
            streams = layer(streams, input_ids, attend)
        self.states.commit(meta, staged)
        return self.model.norm(self.model.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden) -> (R, vocab) float32."""
        return self.lm_head(hidden).float()
