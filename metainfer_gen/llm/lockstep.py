"""Tensor-parallel ranks stepping one engine in lockstep: rank 0 schedules, every rank runs the same forward.

Under tensor parallelism each layer's collectives need every rank in the same forward, but requests reach rank 0
only (the HTTP server, the CLI). Rank 0 keeps the whole engine (scheduler, block manager, sampling); before each
step's forward it broadcasts the step's plan (per scheduled sequence: its id, first position, the token ids of the
step, its block table) on a control group of its own, with the ids of the sequences it released since the last
step (finished or aborted: a model with per-sequence state, DeepSeek-V4's compressor buffers, frees theirs on every
rank). The other ranks rebuild the step from the plan and run the forward and the LM head's gather, dropping the
logits; rank 0 samples. A message without a plan (its last releases only) stops them.

    lead = Lockstep.lead(engine)     # rank 0, after load and warm-up: engine.step() now broadcasts
    ...                              # serve / generate
    lead.stop()                      # the other ranks return from follow()

    Lockstep.follow(engine)          # ranks 1..N-1, after the same load and warm-up; returns at stop

Source followed: vLLM's multiprocessing executor, where the driver broadcasts each step's scheduler output to the
workers (``broadcast_tensor_dict`` / a shared-memory message queue); here a pickled plan on a gloo group.
"""

from __future__ import annotations

import datetime

from metainfer_gen.llm.scheduler import ScheduledSequence, SchedulerOutput
from metainfer_gen.llm.sequence import SamplingParams, Sequence

# The control group waits while the server is idle: far longer than the collectives' per-op timeout. A rank 0 that
# dies without stopping the others is caught by the launcher (its workers watch their parent), not by this wait.
IDLE_TIMEOUT = datetime.timedelta(days=7)
_FOLLOWER_PARAMS = SamplingParams(max_new_tokens=1, temperature=0.0)


def plan(out: SchedulerOutput) -> list[tuple[int, int, list[int], list[int], int]]:
    """The step as plain data: ``(seq_id, start, token ids of the step, block table, sequence length)`` per
    scheduled sequence. The length decides whether the step samples the sequence (a prefill chunk that stops short
    of the prompt's end does not), and so which rows reach the LM head's gather on every rank."""
    return [(item.seq.seq_id, item.start, item.seq.token_ids[item.start: item.start + item.num_tokens],
             list(item.seq.block_table), len(item.seq)) for item in out.scheduled]


def rebuild(step: list[tuple[int, int, list[int], list[int], int]]) -> SchedulerOutput:
    """A :class:`SchedulerOutput` with the same inputs as the planned one: the step's tokens at their positions,
    the block tables, and sequences of the planned lengths, so each one samples exactly when it does on rank 0
    (tokens outside the step are zeros: only the step's tokens, positions and block tables reach the forward)."""
    out = SchedulerOutput()
    for seq_id, start, tokens, block_table, length in step:
        seq = Sequence([0] * start + tokens + [0] * (length - start - len(tokens)), _FOLLOWER_PARAMS, seq_id=seq_id)
        seq.block_table = block_table
        out.scheduled.append(ScheduledSequence(seq, start, len(tokens)))
    return out


class _LeadRunner:
    """Rank 0's runner: broadcasts each step's plan (and the sequences released since the last one), then runs it;
    everything else is the wrapped runner's."""

    def __init__(self, runner, lockstep: "Lockstep"):
        self._runner = runner
        self._lockstep = lockstep

    def run(self, out: SchedulerOutput) -> dict[int, int]:
        self._lockstep.send(plan(out))
        return self._runner.run(out)

    def release(self, seq) -> None:
        """Release ``seq`` here, and on the other ranks with the next message."""
        self._lockstep.released.append(seq.seq_id)
        self._runner.release(seq)

    def __getattr__(self, name):
        return getattr(self._runner, name)


class Lockstep:
    """The control channel of one tensor-parallel group (create it on every rank, in the same order).

    Args:
        engine: this rank's :class:`~metainfer_gen.llm.engine.LLMEngine` (``tensor_parallel_size`` > 1).
    Raises:
        ValueError: the engine is not tensor-parallel.
    """

    def __init__(self, engine):
        import torch.distributed as dist

        from metainfer_gen import collectives

        if engine.config.tensor_parallel_size < 2:
            raise ValueError("lockstep needs a tensor-parallel engine (tensor_parallel_size >= 2)")
        handle = collectives.get_state().groups["tp"]
        self.engine = engine
        self.rank = handle.rank
        self._src = handle.ranks[0]
        self._group = dist.new_group(list(handle.ranks), backend="gloo", timeout=IDLE_TIMEOUT)
        self._stopped = False
        self.released: list[int] = []  # rank 0: sequence ids released since the last message

    @classmethod
    def lead(cls, engine) -> "Lockstep":
        """Rank 0: from now on ``engine.step()`` broadcasts each step before running it."""
        lockstep = cls(engine)
        if lockstep.rank != 0:
            raise RuntimeError(f"Lockstep.lead runs on TP rank 0; this is rank {lockstep.rank} (call follow)")
        engine.runner = _LeadRunner(engine.runner, lockstep)
        return lockstep

    @classmethod
    def follow(cls, engine) -> int:
        """Ranks 1..N-1: run every step rank 0 broadcasts until it stops; returns the number of steps run."""
        lockstep = cls(engine)
        release = getattr(engine.runner.model, "release_sequence", None)
        num_steps = 0
        while True:
            step, released = lockstep.receive()
            for seq_id in released if release is not None else ():
                release(seq_id)
            if step is None:
                break
            with engine.compile_guard():
                engine.runner.forward_logits(rebuild(step))
            num_steps += 1
        return num_steps

    def send(self, step) -> None:
        """Rank 0: broadcast one step's plan (None: stop) with the sequences released since the last message."""
        import torch.distributed as dist

        message, self.released = (step, self.released), []
        dist.broadcast_object_list([message], src=self._src, group=self._group)

    def receive(self):
        """The next message from rank 0: (plan, or None to stop; ids of the sequences it released)."""
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=self._src, group=self._group)
        return box[0]

    def stop(self) -> None:
        """Rank 0: release the other ranks from :meth:`follow`; idempotent."""
        if not self._stopped:
            self._stopped = True
            self.send(None)
