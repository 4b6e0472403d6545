"""Sampling filters and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm.sampler import filter_logits, sample
from metainfer_gen.llm.sequence import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [None, None]) == [1, 0]


def test_top_k_keeps_k_best():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_k=2)))
    assert kept.tolist() == [False, True, True, False]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(filter_logits(probs.log(), SamplingParams(top_p=0.75)))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.75, 0.5 + 0.3 reaches it
    kept = torch.isfinite(filter_logits(probs.log(), SamplingParams(top_p=0.1)))
    assert kept.tolist() == [True, False, False, False]  # the top token always stays


def test_seeded_requests_reproduce_regardless_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=123)
    alone = sample(logits[1:2], [p], [torch.Generator().manual_seed(123)])
    batched = sample(logits, [SamplingParams(temperature=0.7, seed=5), p, SamplingParams(temperature=1.0)],
                     [torch.Generator().manual_seed(5), torch.Generator().manual_seed(123), torch.Generator()])
    assert batched[1] == alone[0]


def test_sampling_follows_the_distribution():
    g = torch.Generator().manual_seed(0)
    draws = [sample(torch.tensor([[0.0, 2.0]]), [SamplingParams(temperature=1.0)], [g])[0] for _ in range(2000)]
    share = sum(draws) / len(draws)
    expected = torch.tensor([0.0, 2.0]).softmax(-1)[1].item()  # 0.881
    assert abs(share - expected) < 0.03


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(seed=1.5), "seed"),
])
def test_bad_params_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_seed_outside_64_bits_is_refused_at_the_request():
    import pytest

    from metainfer_gen.llm import SamplingParams

    with pytest.raises(ValueError, match="64-bit"):
        SamplingParams(seed=2**70)
    SamplingParams(seed=2**64 - 1)
