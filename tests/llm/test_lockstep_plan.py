"""The tensor-parallel lockstep's plan rebuilds each step exactly: same tokens, positions, block tables, and the
same rows sampled (a prefill chunk short of the prompt's end samples nothing, on rank 0 and on every follower)."""

from __future__ import annotations

from metainfer_gen.llm.lockstep import plan, rebuild
from metainfer_gen.llm.scheduler import ScheduledSequence, SchedulerOutput
from metainfer_gen.llm.sequence import SamplingParams, Sequence


def _step() -> SchedulerOutput:
    params = SamplingParams(max_new_tokens=4)
    chunked = Sequence(list(range(100, 200)), params)  # a 100-token prompt, chunk 0..40: not sampled
    chunked.block_table = [3, 4, 5]
    tail = Sequence(list(range(50)), params)  # the last chunk of a 50-token prompt: sampled
    tail.block_table = [7, 8, 9, 10]
    decode = Sequence(list(range(30)), params)  # a decode of one token: sampled
    decode.block_table = [1, 2]
    return SchedulerOutput(scheduled=[ScheduledSequence(chunked, 0, 40), ScheduledSequence(tail, 32, 18),
                                      ScheduledSequence(decode, 29, 1)])


def test_rebuilt_step_has_the_same_inputs_and_samples_the_same_rows():
    original = _step()
    rebuilt = rebuild(plan(original))
    assert [item.sample for item in original.scheduled] == [False, True, True]
    assert [item.sample for item in rebuilt.scheduled] == [False, True, True]
    for want, got in zip(original.scheduled, rebuilt.scheduled):
        assert (got.seq.seq_id, got.start, got.num_tokens, got.seq.block_table) == \
            (want.seq.seq_id, want.start, want.num_tokens, want.seq.block_table)
        assert got.seq.token_ids[got.start: got.start + got.num_tokens] == \
            want.seq.token_ids[want.start: want.start + want.num_tokens]
        assert len(got.seq) == len(want.seq)
    assert rebuilt.num_tokens == original.num_tokens == 59
