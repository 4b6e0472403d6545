"""Scheduler policy without a model: token budget, chunked prefill, admission order, preemption, finishing."""

from __future__ import annotations

from metainfer_gen.llm.block_manager import BlockManager
from metainfer_gen.llm.scheduler import Scheduler
from metainfer_gen.llm.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, budget=16, max_seqs=8, chunked=True, max_len=64, eos=(0,)):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                     max_model_len=max_len, eos_token_ids=eos)


def seq(n, max_new=4, first=1, **kw) -> Sequence:
    return Sequence(list(range(first, first + n)), SamplingParams(max_new_tokens=max_new, **kw))


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {item.seq.seq_id: token for item in out.scheduled if item.sample}
    return out, sched.update(out, sampled)


def test_long_prompt_is_chunked_within_budget():
    sched = make(budget=8)
    s = seq(20)
    sched.add(s)
    chunks = []
    while s.num_output_tokens == 0:
        out, _ = step(sched)
        chunks.append(out.num_tokens)
    assert chunks == [8, 8, 4]


def test_decodes_go_first_and_share_budget_with_a_new_prompt():
    sched = make(budget=8)
    a = seq(3)
    sched.add(a)
    step(sched)  # a prefilled, one token sampled
    b = seq(20, first=50)
    sched.add(b)
    out, _ = step(sched)
    assert [(i.seq, i.num_tokens) for i in out.scheduled] == [(a, 1), (b, 7)]


def test_without_chunking_a_prompt_waits_for_a_step_that_fits_it():
    sched = make(budget=10, chunked=False)
    a, b = seq(6), seq(6, first=20)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert [i.seq for i in out.scheduled] == [a]  # b (6 tokens) does not fit the remaining 4
    out, _ = step(sched)
    assert {i.seq for i in out.scheduled} == {a, b}


def test_max_num_seqs_caps_admission():
    sched = make(max_seqs=2, budget=64)
    seqs = [seq(3, first=10 * i + 1) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_preemption_frees_blocks_and_recomputes():
    # 4 blocks of 4 tokens; two sequences of 7 tokens take 2 blocks each, and the first decode needs a third.
    sched = make(num_blocks=4, block_size=4, budget=32)
    a, b = seq(7, max_new=8), seq(7, max_new=8, first=30)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled (8 tokens each now, cache holds 7)
    out, _ = step(sched)  # both decode into their second block's last slot
    out, _ = step(sched)  # a needs a new block: b (admitted last) is preempted
    assert out.preempted == [b] and b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 2  # its tokens are kept for recompute
    assert sched.num_preemptions == 1
    while sched.has_unfinished:
        step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert sched.block_manager.num_free_blocks == 4


def test_sequence_preempts_itself_when_nothing_else_can_go():
    sched = make(num_blocks=3, block_size=4, budget=32)
    a = seq(11, max_new=4)
    b = seq(1, max_new=4, first=60)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 3 blocks (11 tokens computed + 1 sampled); b cannot be admitted
    assert len(sched.running) == 1
    out, _ = step(sched)  # a decodes within its third block
    assert out.scheduled[0].seq is a


def test_finish_on_eos_stop_token_and_length():
    sched = make()
    eos, stop, length = seq(2, max_new=4), seq(2, max_new=4, first=20, stop_token_ids=(7,)), seq(2, max_new=2,
                                                                                                     first=40)
    sched.add(eos)
    out = sched.schedule()
    finished = sched.update(out, {eos.seq_id: 0})
    assert finished == [eos] and eos.finish_reason is FinishReason.STOP
    sched.add(stop)
    step(sched, token=7)
    assert stop.finish_reason is FinishReason.STOP
    sched.add(length)
    step(sched, token=5)
    step(sched, token=5)
    assert length.finish_reason is FinishReason.LENGTH and length.output_token_ids == [5, 5]
    assert sched.block_manager.num_free_blocks == 16


def test_ignore_eos_and_max_model_len():
    sched = make(max_len=6)
    s = seq(4, max_new=10, ignore_eos=True)
    sched.add(s)
    step(sched, token=0)
    assert not s.is_finished  # EOS ignored
    step(sched, token=0)
    assert s.finish_reason is FinishReason.LENGTH and len(s) == 6


def test_a_failed_row_ends_its_sequence_alone_and_caches_nothing_of_its_step():
    """A sequence in ``errors`` (here mid-prefill: a chunk that does not sample) finishes with its reason, its
    blocks free and none of this step's registered; the other sequence of the step advances as usual."""
    sched = make(budget=12)
    bad, good = seq(16, first=30), seq(3)
    sched.add(good)
    sched.add(bad)
    out = sched.schedule()
    assert [(i.seq, i.sample) for i in out.scheduled] == [(good, True), (bad, False)]
    finished = sched.update(out, {good.seq_id: 7}, errors={bad.seq_id: "computing its tokens failed (RuntimeError)"})
    assert finished == [bad] and bad.finish_reason is FinishReason.ERROR and bad.error.startswith("computing")
    assert good.output_token_ids == [7] and good.num_computed_tokens == 3 and sched.running == [good]
    assert sched.block_manager.num_free_blocks == 16 - len(good.block_table)
    assert sched.block_manager._hash_to_block == {}  # bad's two full blocks of this step were not registered
