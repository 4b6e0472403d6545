"""Continuous batching with chunked prefill and recompute preemption.

Each step gets a token budget (``max_num_batched_tokens``). Running sequences go first, oldest first: a decode
costs one token, an unfinished prefill its next chunk. Waiting sequences are then admitted first come, first
served while budget, sequence slots and KV blocks last; with chunked prefill a long prompt takes what budget is
left and continues next step, so decodes never stall behind a long prompt (vLLM V1's unified scheduler, SGLang's
chunked prefill). When a sequence needs a block and none is free, the most recently admitted running sequence
is preempted: its blocks are freed and it re-enters the queue at the front, to be recomputed (its prefix blocks
usually come back from the prefix cache). Nothing here touches torch; the block manager decides capacity.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from metainfer_gen.llm.block_manager import BlockManager
from metainfer_gen.llm.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """``seq`` computes tokens ``[start, start + num_tokens)`` this step; ``sample`` when that reaches its end."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def sample(self) -> bool:
        return self.start + self.num_tokens == len(self.seq)


@dataclass(slots=True)
class SchedulerOutput:
    """One step: what runs, what was preempted; ``scratch`` marks a step of stand-in sequences (the warm-up), whose
    ids a model must not keep state under."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    scratch: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which sequences run and how many of their tokens.

    Args:
        block_manager: KV block pool.
        max_num_seqs: running sequences at most (the decode batch size).
        max_num_batched_tokens: tokens per step (prefill chunks + decodes).
        enable_chunked_prefill: split prompts longer than the remaining budget across steps; without it a prompt
            is admitted only when it fits whole (then ``max_num_batched_tokens`` must cover ``max_model_len``).
        max_model_len: context length; a sequence that reaches it finishes with reason ``length``.
        eos_token_ids: tokens that end a request unless its params say ``ignore_eos``.
    """

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, max_model_len: int, eos_token_ids: tuple[int, ...] = ()):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is, freeing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling -----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, num_tokens, scheduled_ids, out):
                continue  # preempted itself
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_tokens))
            scheduled_ids.add(seq.seq_id)
            budget -= num_tokens
        # Admit new work only when nothing was preempted: free blocks are then really spare (vLLM's rule).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.block_manager.match_prefix(seq)
            num_tokens = seq.num_uncomputed_tokens
            if num_tokens > budget:
                if not self.enable_chunked_prefill:
                    self.block_manager.free(seq)
                    break
                num_tokens = budget
            if not self.block_manager.can_allocate(self.block_manager.blocks_needed(seq, num_tokens)):
                self.block_manager.free(seq)  # returns the matched blocks; their hashes stay registered
                break
            self.block_manager.allocate(seq, num_tokens)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_tokens))
            scheduled_ids.add(seq.seq_id)
            budget -= num_tokens
        return out

    def _reserve(self, seq: Sequence, num_tokens: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        """Allocate ``seq``'s blocks for this step, preempting later sequences if needed; False if ``seq``
        itself had to be preempted."""
        bm = self.block_manager
        while not bm.can_allocate(bm.blocks_needed(seq, num_tokens)):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled_ids), None)
            self._preempt(victim, out)
            if victim is seq:
                return False
        bm.allocate(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # -- after the model ran --------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, int], now: float | None = None,
               logprobs: dict | None = None, errors: dict[int, str] | None = None) -> list[Sequence]:
        """Advance the scheduled sequences, append sampled tokens (``seq_id -> token``) and their ``logprobs``
        (``seq_id -> TokenLogprobs``, for the requests that asked), finish what is done; a sequence in ``errors``
        (``seq_id -> reason``: its row could not be computed or sampled) finishes with reason "error" and that
        ``error``, its blocks of this step not registered in the prefix cache.

        Returns:
            the sequences that finished this step (their blocks are already free).
        """
        finished = []
        for item in out.scheduled:
            seq = item.seq
            if errors and seq.seq_id in errors:  # its row failed: it ends, alone, with the reason
                seq.error = errors[seq.seq_id]
                self._finish(seq, FinishReason.ERROR)  # before commit: KV of a failed forward is never registered
                finished.append(seq)
                continue
            seq.num_computed_tokens = item.start + item.num_tokens
            self.block_manager.commit(seq)
            if not item.sample:
                continue
            token = sampled[seq.seq_id]
            seq.append_token(token, now)
            if logprobs and seq.seq_id in logprobs:
                seq.logprobs.append(logprobs[seq.seq_id])
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)
        self.block_manager.free(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_new_tokens or len(seq) >= self.max_model_len:
            return FinishReason.LENGTH
        return None
