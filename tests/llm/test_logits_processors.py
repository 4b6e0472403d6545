"""Penalties, min_tokens and logprobs: batched against a plain per-row reference on fixed logits, and logprobs
against a log-softmax of transformers' logits on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.logits_processors import apply_penalties, compute_logprobs, mask_early_stops
from metainfer_gen.llm.sequence import Sequence
from tests.llm.checkpoints import random_prompts

VOCAB = 12


def _seq(prompt, output, **params) -> Sequence:
    seq = Sequence(list(prompt), SamplingParams(max_new_tokens=16, **params))
    for token in output:
        seq.append_token(token)
    return seq


def _reference(logits: list[float], seq: Sequence) -> list[float]:
    """vLLM's order, one token at a time: repetition (prompt + output), then frequency and presence (output)."""
    p, out = seq.params, seq.output_token_ids
    seen = set(seq.prompt_token_ids) | set(out)
    result = []
    for token, value in enumerate(logits):
        if token in seen:
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        count = out.count(token)
        value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        result.append(value)
    return result


def test_penalties_equal_the_reference_on_fixed_logits():
    logits = torch.linspace(-3.0, 3.0, 3 * VOCAB).reshape(3, VOCAB)
    seqs = [_seq([1, 2, 2], [3, 3, 3, 7], presence_penalty=0.5, frequency_penalty=0.25),
            _seq([0, 11], [5, 11, 5], repetition_penalty=1.3),
            _seq([4], [4, 6, 6], presence_penalty=-0.7, frequency_penalty=1.5, repetition_penalty=0.8)]
    got = apply_penalties(logits.clone(), seqs)
    want = torch.tensor([_reference(row, seq) for row, seq in zip(logits.tolist(), seqs)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not torch.equal(got, logits)


def test_extreme_penalties_keep_the_logits_finite():
    """A repetition penalty of 5e-324 (0 in float32) or 100 and frequency penalties of +-2 on a long output: every
    logit finite, and the tiny repetition penalty makes a seen token (positive logit) the greedy choice."""
    logits = torch.stack([torch.linspace(0.5, 1.0, VOCAB), torch.linspace(-3.0, 3.0, VOCAB)])
    seqs = [_seq([1, 2], [3] * 40, repetition_penalty=5e-324, frequency_penalty=2.0),
            _seq([7], [8] * 40, repetition_penalty=100.0, frequency_penalty=-2.0, presence_penalty=-2.0)]
    got = apply_penalties(logits.clone(), seqs)
    assert torch.isfinite(got).all()
    assert int(got[0].argmax()) in (1, 2, 3) and (got[0, [1, 2, 3]] == torch.finfo(torch.float32).max).all()


def test_rows_without_penalties_are_left_as_they_are():
    logits = torch.randn(2, VOCAB)
    seqs = [_seq([1], [2, 2]), _seq([3], [4], frequency_penalty=1.0)]
    got = apply_penalties(logits, seqs)
    torch.testing.assert_close(got[0], logits[0], atol=0, rtol=0)
    assert got[1, 4] == logits[1, 4] - 1.0
    assert apply_penalties(logits, [_seq([1], [2])]) is logits  # no penalty anywhere: nothing computed


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, VOCAB)
    seqs = [_seq([1], [2], min_tokens=3, stop_token_ids=(9,)),  # short: EOS 0 and stop 9 masked
            _seq([1], [2, 3, 4], min_tokens=3, stop_token_ids=(9,)),  # reached: nothing masked
            _seq([1], [], min_tokens=2, ignore_eos=True)]  # ignore_eos: EOS stays allowed
    got = mask_early_stops(logits, seqs, eos_token_ids=(0,))
    assert torch.isinf(got[0]).nonzero().flatten().tolist() == [0, 9]
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()


def test_compute_logprobs_is_a_log_softmax_with_the_top_tokens():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    seqs = [_seq([1], [], logprobs=3), _seq([1], []), _seq([2], [], logprobs=0)]
    got = compute_logprobs(logits, [5, 6, 7], seqs)
    assert set(got) == {seqs[0].seq_id, seqs[2].seq_id}
    reference = logits.log_softmax(-1)
    first = got[seqs[0].seq_id]
    assert first.token_id == 5 and abs(first.logprob - reference[0, 5].item()) < 1e-6
    top = reference[0].topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert got[seqs[2].seq_id].top == ()


@pytest.mark.parametrize("field, value", [("min_tokens", 17), ("min_tokens", -1), ("presence_penalty", 2.5),
                                          ("frequency_penalty", -3), ("repetition_penalty", 0),
                                          ("logprobs", 21), ("logprobs", True)])
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_new_tokens=16, **{field: value})


def test_engine_logprobs_match_transformers_log_softmax(hf_checkpoint):
    model, path = hf_checkpoint
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4))
    prompt = random_prompts(1, model.config.vocab_size, (9,), seed=3)[0]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True,
                                                   logprobs=4))[0]
    assert len(out.logprobs) == 6 and [e.token_id for e in out.logprobs] == out.token_ids
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0].float()
    reference = logits[len(prompt) - 1:].log_softmax(-1)  # the distribution each generated token was drawn from
    for step, entry in enumerate(out.logprobs):
        assert abs(entry.logprob - reference[step, entry.token_id].item()) < 1e-4
        top = reference[step].topk(4)
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_engine_min_tokens_and_penalties_change_the_run(hf_checkpoint):
    model, path = hf_checkpoint
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4))
    prompt = random_prompts(1, model.config.vocab_size, (5,), seed=4)[0]
    greedy = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop = greedy.token_ids[1]  # a token greedy decoding emits second: as a stop token it ends the run there
    short = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                     stop_token_ids=(stop,)))[0]
    held = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,),
                                                    min_tokens=6, ignore_eos=True))[0]
    assert len(short.token_ids) <= 2 and short.finish_reason == "stop"
    assert len(held.token_ids) >= 6 and stop not in held.token_ids[:6]
    penalised = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True,
                                                         frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert len(set(penalised.token_ids)) >= len(set(greedy.token_ids))
