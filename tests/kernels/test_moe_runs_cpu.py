"""The C++ prefill-sized routed experts (``cpp-runs``) against the per-expert reference loop and the dense float64
sum: runs of every length (bucket padding in bf16), widths that are not multiples of the vector width, experts with
no token, one expert taking every token, another rank's expert range, the refusals and the registry's choice.
Tolerance: atol = rtol = 1e-5 in float32; in bf16 the grouped path's and the reference's values (the same
roundings: under 0.1% of the elements may differ, by one bf16 step) and atol = rtol = 5e-2 of the float64 sum."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import audit, gemm, moe, moe_cpu, moe_runs_cpu
from tests.kernels.conftest import require_cpu_kernel
from tests.kernels.test_moe_cpu import _dense_wide

HIDDEN = 64


@pytest.fixture(scope="module", autouse=True)
def built():
    require_cpu_kernel(moe_runs_cpu.warm_up)


def _case(tokens: int, experts: int, top_k: int, width: int = 48, hidden: int = HIDDEN, skip: tuple[int, ...] = (),
          seed: int = 0, dtype: torch.dtype = torch.float32, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in skip])
    ids = allowed[torch.rand(tokens, len(allowed), generator=g).argsort(-1)[:, :top_k]]
    if skew:  # expert 0 in every token's top-k: one run of every token
        rest = 1 + torch.rand(tokens, experts - 1, generator=g).argsort(-1)[:, :top_k - 1]
        ids = torch.cat([torch.zeros(tokens, 1, dtype=torch.long), rest], dim=1)
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * width, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, width, generator=g) / width ** 0.5
    return x.to(dtype), weights, ids, w13.to(dtype), w2.to(dtype)


CASES = [
    dict(tokens=300, experts=8, top_k=2),  # runs of about 75 rows
    dict(tokens=257, experts=16, top_k=4, skip=(2, 9)),  # experts with no token
    dict(tokens=200, experts=5, top_k=3, width=40, hidden=72),  # widths with a scalar tail
    dict(tokens=130, experts=4, top_k=2, skew=True),  # one expert takes every token
]


@pytest.mark.parametrize("case", CASES)
def test_float32_matches_reference(case):
    for seed in range(2):
        x, weights, ids, w13, w2 = _case(**case, seed=seed)
        assert moe_runs_cpu.moe_experts_runs_cpp_supports(x, weights, ids, w13, w2) is None
        got = moe_runs_cpu.moe_experts_runs_cpp(x, weights, ids, w13, w2)
        torch.testing.assert_close(got, moe.moe_experts_reference(x, weights, ids, w13, w2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.double(), _dense_wide(x, weights, ids, w13, w2, 0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_bf16_rounds_as_the_grouped_path_and_the_reference(case):
    for seed in range(2):
        x, weights, ids, w13, w2 = _case(**case, seed=seed, dtype=torch.bfloat16)
        got = moe_runs_cpu.moe_experts_runs_cpp(x, weights, ids, w13, w2)
        assert got.dtype == torch.bfloat16
        grouped = moe.moe_experts_grouped(x, weights, ids, w13, w2)
        for other in (grouped, moe.moe_experts_reference(x, weights, ids, w13, w2)):
            # the same roundings (gate/up, silu, silu x up, down, each weighted output, each partial sum): equal but
            # for a float32 silu landing on the other side of a bf16 rounding boundary now and then
            assert (got != other).float().mean() < 1e-3
            torch.testing.assert_close(got.float(), other.float(), atol=1e-2, rtol=1e-2)
        exact = _dense_wide(x, weights, ids, w13, w2, 0).float()
        torch.testing.assert_close(got.float(), exact, atol=5e-2, rtol=5e-2)


def test_other_ranks_experts_and_tokens_without_a_local_expert():
    x, weights, ids, w13, w2 = _case(300, 8, 2)
    local13, local2 = w13[4:].contiguous(), w2[4:].contiguous()  # this rank holds experts 4..7
    got = moe_runs_cpu.moe_experts_runs_cpp(x, weights, ids, local13, local2, 4)
    torch.testing.assert_close(got.double(), _dense_wide(x, weights, ids, local13, local2, 4), atol=1e-5, rtol=1e-5)
    untouched = ~((ids >= 4).any(-1))
    assert untouched.any() and not got[untouched].any()
    assert not moe_runs_cpu.moe_experts_runs_cpp(x, weights, ids, local13, local2, 8).any()  # none held here


def test_bucket_rows_agree_with_the_python_buckets():
    kernel = moe_runs_cpu.ensure_built(moe_runs_cpu.KERNEL)
    assert [kernel.bucket_rows(m) for m in range(1, 5000)] == [gemm.bucket_rows(m) for m in range(1, 5000)]


def test_registry_picks_it_past_the_decode_kernel_and_says_why_not_below():
    x, weights, ids, w13, w2 = _case(300, 8, 2)
    with audit() as report:
        out = moe.moe_experts(x, weights, ids, w13, w2, site="test.moe_runs")
    (entry,) = [e for e in report.entries if e.op == "moe_experts"]
    assert entry.path == "cpp-runs"
    assert [r.implementation for r in entry.refusals] == ["cpp"]  # 600 pairs: past the decode kernel's 32 an expert
    torch.testing.assert_close(out, moe.moe_experts_reference(x, weights, ids, w13, w2), atol=1e-5, rtol=1e-5)
    refusal = moe_runs_cpu.moe_experts_runs_cpp_supports
    small = _case(moe_cpu.max_pairs_per_expert(torch.float32) * 8 // 2, 8, 2)  # exactly the decode kernel's limit
    assert "decode-sized (at most 32 an expert in torch.float32)" in refusal(*small)
    assert refusal(*_case(moe_cpu.max_pairs_per_expert(torch.float32) * 8 // 2 + 1, 8, 2)) is None
    assert refusal(*_case(300, 8, 2, dtype=torch.float16)) == "x dtype float16 not in (float32, bfloat16)"
    assert refusal(x, weights, ids, w13.to(torch.bfloat16), w2.to(torch.bfloat16)).startswith("expert weights")
    assert "not contiguous" in refusal(x, weights, ids, w13.transpose(1, 2).contiguous().transpose(1, 2), w2)
    assert "need float32 / int64" in refusal(x, weights.double(), ids, w13, w2)
    with torch.enable_grad():
        assert "autograd" in refusal(x.requires_grad_(), weights, ids, w13, w2)


def test_bad_input_is_an_error_not_a_crash():
    x, weights, ids, w13, w2 = _case(300, 8, 2)
    kernel = moe_runs_cpu.ensure_built(moe_runs_cpu.KERNEL)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.moe_runs(x.double(), weights, ids, w13, w2, 0, False)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        kernel.moe_runs(x.to(torch.bfloat16), weights, ids, w13, w2, 0, True)
    with pytest.raises(RuntimeError, match="ids must be"):
        kernel.moe_runs(x, weights, ids.int(), w13, w2, 0, False)
    with pytest.raises(RuntimeError, match="weights must be"):
        kernel.moe_runs(x, weights[:, :1].contiguous(), ids, w13, w2, 0, False)
