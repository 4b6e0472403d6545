"""The batched sampler against the per-row reference: the same distribution, the same greedy tokens, seeded rows
independent of their batch, and every numeric extreme the request checks allow either sampled or one row's error."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm.sampler import MAX_TOPK_CANDIDATES, NOT_FINITE, sample
from metainfer_gen.llm.sampler_reference import filter_logits, sample_reference
from metainfer_gen.llm.sequence import SamplingParams

SP = SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    assert sample(logits, [SP(temperature=0)] * 2, [None, None]).tokens == [1, 0]


def test_top_k_keeps_k_best():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    kept = torch.isfinite(filter_logits(logits, SP(top_k=2)))
    assert kept.tolist() == [False, True, True, False]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(filter_logits(probs.log(), SP(top_p=0.75)))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.75, 0.5 + 0.3 reaches it
    kept = torch.isfinite(filter_logits(probs.log(), SP(top_p=0.1)))
    assert kept.tolist() == [True, False, False, False]  # the top token always stays


def _frequencies(logits: torch.Tensor, params: SamplingParams, num: int, seed: int = 0) -> torch.Tensor:
    """(V,) share of each token in ``num`` draws of one row, drawn as one batch of ``num`` identical rows."""
    torch.manual_seed(seed)
    out = sample(logits.expand(num, -1).contiguous(), [params] * num, [None] * num)
    assert not out.errors
    return torch.bincount(torch.tensor(out.tokens), minlength=logits.numel()).double() / num


# V = 1000 is not a multiple of the 256-token blocks (padding); top_k 2000 > MAX_TOPK_CANDIDATES takes the full
# path's kthvalue cut; scale 0.3 makes top-p 0.95 need most of the vocabulary (rejection rounds).
@pytest.mark.parametrize("params, scale", [
    (SP(temperature=0.8), 2.0), (SP(top_k=5), 2.0), (SP(top_k=40, temperature=1.7), 1.0),
    (SP(top_p=0.5), 2.0), (SP(top_p=0.95, temperature=3.0), 0.3), (SP(top_k=20, top_p=0.7, temperature=1.3), 2.0),
    (SP(top_k=MAX_TOPK_CANDIDATES + 300, top_p=0.9), 1.0),
])
def test_draws_follow_the_reference_distribution(params, scale):
    vocab = 1000 if params.top_k <= MAX_TOPK_CANDIDATES else 3000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * scale
    reference = filter_logits(logits, params).softmax(-1).double()
    num = 40_000
    share = _frequencies(logits, params, num)
    assert share[reference == 0].sum() == 0  # nothing outside the reference's kept set
    kept = reference > 0
    chi2 = float((num * (share[kept] - reference[kept]) ** 2 / reference[kept]).sum())
    dof = int(kept.sum()) - 1  # Pearson's test: chi2 ~ dof +- sqrt(2 dof); 6 sigma is far off any false alarm
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (chi2, dof)


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([5.0, 3.0, 3.0, 3.0, 1.0, 0.0])  # k = 2: the reference keeps 5 and all three 3s
    share = _frequencies(logits, SP(top_k=2), 20_000)
    assert share[4:].sum() == 0 and (share[1:4] > 0.02).all()


@pytest.mark.parametrize("params", [SP(temperature=0.9), SP(top_k=7), SP(top_p=0.6), SP(top_k=30, top_p=0.8)])
def test_a_seeded_row_does_not_depend_on_its_batch(params):
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(6, 700, generator=g) * 2 for _ in range(20)]
    seeded = [torch.Generator().manual_seed(2**64 - 1) for _ in range(2)]
    neighbours = [SP(temperature=0), SP(top_k=500), SP(top_p=0.99, temperature=2.0), SP(temperature=1e-40),
                  SP(top_k=3, top_p=0.5)]
    alone = [sample(x[2:3], [params], [seeded[0]]).tokens[0] for x in steps]
    batched = [sample(x, neighbours[:2] + [params] + neighbours[2:], [torch.Generator()] * 2 + [seeded[1]]
                      + [torch.Generator()] * 3).tokens[2] for x in steps]
    assert batched == alone
    again = torch.Generator().manual_seed(2**64 - 1)
    assert [sample(x[2:3], [params], [again]).tokens[0] for x in steps] == alone


def test_greedy_and_near_zero_temperature_give_the_reference_tokens():
    logits = torch.randn(32, 5000, generator=torch.Generator().manual_seed(4))
    params = [SP(temperature=0)] * 16 + [SP(temperature=1e-40, top_p=1e-30, seed=i) for i in range(16)]
    gens = [None] * 16 + [torch.Generator() for _ in range(16)]
    assert sample(logits, params, gens).tokens == logits.argmax(-1).tolist()
    assert sample_reference(logits[:16], params[:16], gens[:16]) == logits[:16].argmax(-1).tolist()


@pytest.mark.parametrize("params", [
    SP(temperature=1e-40), SP(temperature=1e-6), SP(temperature=1e30), SP(temperature=1e308), SP(top_p=1e-30),
    SP(top_k=2**62), SP(top_k=2**62, top_p=1e-30, temperature=1e-30), SP(seed=2**64 - 1, temperature=1e30),
])
def test_numeric_extremes_sample_a_valid_token(params):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 5
    logits[:, ::3] = float("-inf")  # min_tokens and penalties leave -inf behind: never drawn, even at T = 1e308
    out = sample(logits, [params] * 4, [torch.Generator().manual_seed(params.seed or 0) for _ in range(4)])
    assert not out.errors
    assert all(torch.isfinite(logits[r, t]) for r, t in enumerate(out.tokens))
    if params.temperature < 1e-5 or params.top_p < 1e-20:
        assert out.tokens == logits.argmax(-1).tolist()


def test_a_huge_temperature_is_uniform_over_the_unmasked_tokens():
    logits = torch.randn(12) * 10
    logits[:4] = float("-inf")
    share = _frequencies(logits, SP(temperature=1e300), 24_000)
    assert share[:4].sum() == 0 and (share[4:] - 1 / 8).abs().max() < 0.015


def test_a_row_that_is_not_finite_fails_alone():
    logits = torch.randn(4, 600, generator=torch.Generator().manual_seed(6))
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 0] = float("inf")
    params = [SP(top_p=0.9, seed=1), SP(temperature=0), SP(top_k=5), SP(temperature=0.5)]
    out = sample(logits, params, [torch.Generator().manual_seed(1), None, torch.Generator(), torch.Generator()])
    assert out.errors == {1: NOT_FINITE, 2: NOT_FINITE, 3: NOT_FINITE}
    assert out.tokens[0] == sample(logits[:1], params[:1], [torch.Generator().manual_seed(1)]).tokens[0]
    assert out.tokens[1:] == [-1, -1, -1]
    with pytest.raises(RuntimeError):  # the per-row reference fails on the same rows
        sample_reference(logits[2:3], [SP(top_k=5)], [torch.Generator()])


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(seed=1.5), "seed"),
])
def test_bad_params_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_seed_outside_64_bits_is_refused_at_the_request():
    with pytest.raises(ValueError, match="64-bit"):
        SamplingParams(seed=2**70)
    SamplingParams(seed=2**64 - 1)
