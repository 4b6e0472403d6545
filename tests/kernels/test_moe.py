"""Routed MoE experts: the grouped path (padded bmm and per-slice GEMMs) against the per-expert reference loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metainfer_gen.kernels import audit, moe
from tests.kernels.conftest import DTYPES, assert_close, requires_cuda

HIDDEN, WIDTH = 48, 40


def _routing(num_tokens: int, num_experts: int, top_k: int, skip: tuple[int, ...] = (), seed: int = 0):
    """Distinct top-k ids per token drawn from the experts not in ``skip`` (those get zero tokens)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in skip])
    ids = allowed[torch.rand(num_tokens, len(allowed), generator=g).argsort(-1)[:, :top_k]]
    return torch.rand(num_tokens, top_k, generator=g) + 0.1, ids


def _weights(num_local: int, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_local, 2 * WIDTH, HIDDEN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(num_local, HIDDEN, WIDTH, generator=g) / WIDTH ** 0.5
    return w13.to(dtype), w2.to(dtype)


def _dense(x, weights, ids, w13, w2, first):
    """Every expert on every token, combined by a dense (T, E) weight matrix: the sum the docstring states."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        gate, up = w13[e, :WIDTH].double(), w13[e, WIDTH:].double()
        y = F.linear(F.silu(F.linear(x.double(), gate)) * F.linear(x.double(), up), w2[e].double())
        out += (weights.double() * (ids == first + e)).sum(-1, keepdim=True) * y
    return out


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "runs"])
@pytest.mark.parametrize("case", [
    dict(tokens=37, experts=8, top_k=2, skip=()),
    dict(tokens=64, experts=8, top_k=2, skip=(0, 5)),  # experts with zero tokens
    dict(tokens=5, experts=16, top_k=4, skip=(3,)),  # most experts empty, runs of one
    dict(tokens=1, experts=8, top_k=2, skip=()),
])
def test_grouped_equals_reference_in_float32(monkeypatch, padded, case):
    monkeypatch.setattr(moe, "PADDED_MAX_PAIRS", 1 << 30 if padded else 0)
    monkeypatch.setattr(moe, "PADDED_MAX_WASTE", 1e9)
    for seed in range(3):
        weights, ids = _routing(case["tokens"], case["experts"], case["top_k"], case["skip"], seed)
        x = torch.randn(case["tokens"], HIDDEN)
        w13, w2 = _weights(case["experts"], seed=seed)
        ref = moe.moe_experts_reference(x, weights, ids, w13, w2)
        torch.testing.assert_close(moe.moe_experts_grouped(x, weights, ids, w13, w2), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ref.double(), _dense(x, weights, ids, w13, w2, 0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("first", [0, 3, 5])
def test_local_expert_range_skips_other_ranks_experts(first):
    weights, ids = _routing(50, 8, 2, seed=first)
    x = torch.randn(50, HIDDEN)
    w13, w2 = _weights(3)  # experts first .. first + 2 live here
    ref = moe.moe_experts_reference(x, weights, ids, w13, w2, first)
    torch.testing.assert_close(moe.moe_experts_grouped(x, weights, ids, w13, w2, first), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.double(), _dense(x, weights, ids, w13, w2, first), atol=1e-5, rtol=1e-5)
    untouched = ~((ids >= first) & (ids < first + 3)).any(-1)
    assert untouched.any() and not moe.moe_experts_grouped(x, weights, ids, w13, w2, first)[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matches_reference_in_each_dtype(dtype):
    weights, ids = _routing(300, 8, 2, skip=(7,))  # 600 pairs: the per-run path
    x = torch.randn(300, HIDDEN, dtype=dtype)
    w13, w2 = _weights(8, dtype)
    got = moe.moe_experts_grouped(x, weights, ids, w13, w2)
    assert_close(got, moe.moe_experts_reference(x, weights, ids, w13, w2))
    small = slice(0, 20)  # 40 pairs: the padded path
    assert_close(moe.moe_experts_grouped(x[small], weights[small], ids[small], w13, w2),
                 moe.moe_experts_reference(x[small], weights[small], ids[small], w13, w2))


def test_no_tokens_and_no_local_pairs_give_zeros():
    w13, w2 = _weights(2)
    empty = moe.moe_experts(torch.randn(0, HIDDEN), torch.rand(0, 2), torch.zeros(0, 2, dtype=torch.long), w13, w2)
    assert empty.shape == (0, HIDDEN)
    ids = torch.tensor([[0, 1], [1, 0]])
    out = moe.moe_experts(torch.randn(2, HIDDEN), torch.rand(2, 2), ids, w13, w2, first_expert=4)
    assert not out.any()


def test_dispatch_runs_grouped_and_audits_it():
    weights, ids = _routing(16, 8, 2)
    x = torch.randn(16, HIDDEN)
    w13, w2 = _weights(8)
    with audit() as report:
        out = moe.moe_experts(x, weights, ids, w13, w2, site="test.moe")
    (entry,) = [e for e in report.entries if e.op == "moe_experts"]
    assert (entry.path, entry.site) == ("grouped", "test.moe")
    assert [(r.implementation, r.reason) for r in entry.refusals] == [
        ("cpp", "hidden 48 and expert width 40 must be multiples of 16 in torch.float32"),
        ("cpp-runs", "32 pairs over 8 experts: decode-sized (at most 32 an expert in torch.float32), where "
                     "per-expert GEMMs pay more than they save")]
    assert moe.MOE_EXPERTS.names == ["cpp", "cpp-runs", "grouped", "torch"]
    torch.testing.assert_close(out, moe.moe_experts_reference(x, weights, ids, w13, w2), atol=1e-5, rtol=1e-5)


def test_shape_errors_are_reported():
    w13, w2 = _weights(2)
    with pytest.raises(ValueError, match="need x"):
        moe.moe_experts(torch.randn(3, HIDDEN), torch.rand(3, 2), torch.zeros(3, 1, dtype=torch.long), w13, w2)
    with pytest.raises(ValueError, match="need w13"):
        moe.moe_experts(torch.randn(3, HIDDEN), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long), w13,
                        w2.transpose(1, 2))


@requires_cuda
@pytest.mark.parametrize("num_tokens", [16, 600])  # the padded and the per-run path
def test_cuda_grouped_matches_reference(num_tokens):
    weights, ids = _routing(num_tokens, 8, 2, skip=(2,))
    x = torch.randn(num_tokens, HIDDEN)
    w13, w2 = _weights(8)
    args = [t.cuda() for t in (x, weights, ids, w13, w2)]
    torch.testing.assert_close(moe.moe_experts(*args).cpu(), moe.moe_experts_reference(x, weights, ids, w13, w2),
                               atol=1e-5, rtol=1e-5)
