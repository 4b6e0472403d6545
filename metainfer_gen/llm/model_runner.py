"""Owns the device: the model, the paged KV cache tensors, and one forward + sample per engine step.

nano-vllm's ``engine/model_runner.py`` split: the scheduler decides *what* runs; the runner turns that into
flat input tensors and attention metadata, runs the model, computes logits only for the rows that sample, and
samples. Decode-only steps may go through :class:`~metainfer_gen.llm.static_decode.StaticDecode` (static
buffers, CUDA graphs), which lives in its own module; tensor parallelism stays out of this file.
"""

from __future__ import annotations

import logging

import torch

from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.logits_processors import apply_penalties, compute_logprobs, mask_early_stops
from metainfer_gen.llm.sampler import Sampler
from metainfer_gen.llm.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


def cache_layout(model, block_size: int) -> list[tuple[int, int]]:
    """(slots per block, values per slot) of each KV pool tensor: the model's own ``cache_layout(block_size)``
    where it has one (DeepSeek-V4: window rows and compacted compressed entries), else one (block_size, row) per
    ``cache_row_sizes`` entry (MLA latent, + indexer key on DSA layers)."""
    if hasattr(model, "cache_layout"):
        return model.cache_layout(block_size)
    return [(block_size, row) for row in model.cache_row_sizes]


def kv_cache_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all pool tensors (:func:`cache_layout`)."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(slots * row for slots, row in cache_layout(model, block_size)) * element


class ModelRunner:
    """Runs scheduled batches.

    Args:
        model: the engine model (``forward(input_ids, meta, kv_caches)``, ``compute_logits``).
        num_blocks, block_size: KV pool geometry.
        dtype, device: of the cache (the model's).
        seed: generator seed for requests without their own.
        static_decode: run decode-only steps of up to ``max_num_seqs`` sequences on static buffers (needs
            ``max_num_seqs`` and ``max_model_len``); ``cuda_graphs`` replays them as CUDA graphs,
            ``compiled_decode`` runs them as one compiled graph per batch size (CPU).
        compiled_prefill: run every other step of two or more tokens as one compiled graph with a dynamic token
            count (CPU, :mod:`metainfer_gen.llm.compiled_prefill`; built by the warm-up).
        eos_token_ids: the tokens ``min_tokens`` keeps from being sampled early (with each request's stop tokens).
    After each :meth:`run`, ``last_logprobs`` maps ``seq_id`` to the :class:`TokenLogprobs` of the rows that asked,
    and ``last_errors`` ``seq_id`` to why that row got no token.
    """

    def __init__(self, model, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0, static_decode: bool = False, cuda_graphs: bool = False, compiled_decode: bool = False,
                 compiled_prefill: bool = False, max_num_seqs: int = 1, max_model_len: int = 1,
                 eos_token_ids: tuple[int, ...] = ()):
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self.last_logprobs: dict = {}
        self.last_errors: dict[int, str] = {}
        self.block_size = block_size
        self.device = device
        sink = 1 if compiled_decode else 0  # a block past the pool: the padding rows of compiled steps write there
        self.kv_caches = [torch.zeros(num_blocks + sink, slots, 1, row, dtype=dtype, device=device)
                          for slots, row in cache_layout(model, block_size)]
        self._default_generator = torch.Generator().manual_seed(seed)
        self.sampler = Sampler()
        self._generators: dict[int, torch.Generator] = {}
        self.static = None
        if static_decode:
            from metainfer_gen.llm.static_decode import StaticDecode

            self.static = StaticDecode(model, self.kv_caches, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                       block_size=block_size, use_cuda_graphs=cuda_graphs,
                                       compiled=compiled_decode, sink_slot=num_blocks * block_size if sink else None)
        self.compiled_prefill = None
        if compiled_prefill:
            from metainfer_gen.llm.compiled_prefill import CompiledPrefill

            self.compiled_prefill = CompiledPrefill(model, self.kv_caches)

    def generator_for(self, seq) -> torch.Generator:
        if seq.params.seed is None:
            return self._default_generator
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = self._generators[seq.seq_id] = torch.Generator().manual_seed(seq.params.seed)
        return gen

    def release(self, seq) -> None:
        """Forget a finished sequence's generator, and its per-sequence model state where the model keeps one
        (``release_sequence``: DeepSeek-V4's compressor buffers)."""
        self._generators.pop(seq.seq_id, None)
        if hasattr(self.model, "release_sequence"):
            self.model.release_sequence(seq.seq_id)

    def build_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        for item in out.scheduled:
            ids.extend(item.seq.token_ids[item.start: item.start + item.num_tokens])
        meta = AttentionMetadata.build([i.start for i in out.scheduled], [i.num_tokens for i in out.scheduled],
                                       [i.seq.block_table for i in out.scheduled], self.block_size, self.device,
                                       seq_ids=None if out.scratch else [i.seq.seq_id for i in out.scheduled])
        return torch.tensor(ids, dtype=torch.long, device=self.device), meta

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[int]]:
        """Forward the step: (logits (R, vocab) float32, indices in ``out.scheduled`` of the R sampling rows)."""
        if self.static is not None and self.static.can_run(out):
            return self.model.compute_logits(self.static.run(out)), list(range(len(out.scheduled)))
        input_ids, meta = self.build_inputs(out)
        if self.compiled_prefill is not None and input_ids.shape[0] > 1:
            hidden = self.compiled_prefill(input_ids, meta)
        else:
            hidden = self.model(input_ids, meta, self.kv_caches)
        offsets = meta.query_offsets
        rows = [i for i, item in enumerate(out.scheduled) if item.sample]
        if not rows:
            return None, rows
        last = torch.tensor([offsets[i + 1] - 1 for i in rows], dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[last]), rows

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> dict[int, int]:
        """Forward the step, apply penalties and ``min_tokens``, sample; returns ``seq_id -> token`` for the
        sequences that sample (and sets ``last_logprobs``, from the logits before penalties and temperature).

        A row that cannot be sampled (its logits are not finite, or computing its row raised) gets no token: its
        ``seq_id`` is in ``last_errors`` with the reason, and every other row is sampled as if it were alone.
        """
        if out.preempted and hasattr(self.model, "release_sequence"):  # recomputed from 0: its state goes now
            for seq in out.preempted:
                self.model.release_sequence(seq.seq_id)
        logits, rows = self.forward_logits(out)
        self.last_logprobs, self.last_errors = {}, {}
        if not rows:
            return {}
        seqs = [out.scheduled[i].seq for i in rows]
        generators = [None if s.params.greedy else self.generator_for(s) for s in seqs]
        states = {id(g): (g, g.get_state()) for g in generators if g is not None}
        try:
            tokens, errors, self.last_logprobs = self._sample(logits, seqs, generators)
        except Exception:  # one row broke the batched computation: sample row by row to find it
            log.exception("sampling a batch of %d rows failed; sampling them one by one", len(seqs))
            for g, state in states.values():  # each row draws as it would have in the batch
                g.set_state(state)
            tokens, errors = [], {}
            for i, seq in enumerate(seqs):
                try:
                    token, row_errors, logprobs = self._sample(logits[i:i + 1], [seq], generators[i:i + 1])
                except Exception as exc:
                    log.exception("sampling request %s failed", seq.request_id)
                    token, row_errors, logprobs = [-1], {0: f"sampling failed ({type(exc).__name__}); the "
                                                           f"server's log has the details"}, {}
                tokens += token
                errors.update({i: row_errors[0]} if row_errors else {})
                self.last_logprobs.update(logprobs)
        self.last_errors = {seqs[i].seq_id: reason for i, reason in errors.items()}
        return {s.seq_id: t for i, (s, t) in enumerate(zip(seqs, tokens)) if i not in errors}

    def _sample(self, logits: torch.Tensor, seqs: list, generators: list) -> tuple[list[int], dict, dict]:
        """(tokens, row -> error, seq_id -> TokenLogprobs) for the rows of ``logits`` (one per ``seqs``)."""
        processed = mask_early_stops(apply_penalties(logits, seqs), seqs, self.eos_token_ids)
        sampled = self.sampler(processed, [s.params for s in seqs], generators)
        ok = [i for i in range(len(seqs)) if i not in sampled.errors]
        rows = logits if len(ok) == len(seqs) else logits[ok]
        logprobs = compute_logprobs(rows, [sampled.tokens[i] for i in ok], [seqs[i] for i in ok]) if ok else {}
        return sampled.tokens, sampled.errors, logprobs
