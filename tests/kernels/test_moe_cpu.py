"""The C++ CPU routed experts against the per-expert reference loop: decode-sized batches, empty experts, another
rank's expert range, tokens with no local expert, the refusals (dtype, widths, batch size), the registry's choice and
a MoE layer whose compiled decode step calls it. Tolerance: atol = rtol = 1e-5 in float32. bf16 (where the build has
AVX512-BF16) against the float32 reference on the same bf16 inputs: within bf16's rounding and no further from it
than torch's own bf16 path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from metainfer_gen.kernels import audit, moe, moe_cpu
from metainfer_gen.llm.layers.moe import MoE
from tests.kernels.conftest import require_cpu_kernel
from tests.kernels.test_moe import _dense

HIDDEN, WIDTH = 64, 48  # multiples of 16, unlike test_moe's widths


@pytest.fixture(scope="module", autouse=True)
def built():
    require_cpu_kernel(moe_cpu.warm_up)


def _case(tokens: int, experts: int, top_k: int, skip: tuple[int, ...] = (), seed: int = 0,
          dtype: torch.dtype = torch.float32, width: int = WIDTH):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in skip])
    ids = allowed[torch.rand(tokens, len(allowed), generator=g).argsort(-1)[:, :top_k]]
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(experts, 2 * width, HIDDEN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(experts, HIDDEN, width, generator=g) / width ** 0.5
    return x.to(dtype), weights, ids, w13.to(dtype), w2.to(dtype)


def _bf16_built() -> bool:
    return bool(moe_cpu.ensure_built(moe_cpu.KERNEL).avx512_bf16)


BF16_WIDTH = 96  # a multiple of 32: bf16 pairs


@pytest.mark.parametrize("case", [
    dict(tokens=1, experts=16, top_k=4),
    dict(tokens=3, experts=8, top_k=2),
    dict(tokens=16, experts=16, top_k=4, skip=(2, 9)),
    dict(tokens=37, experts=5, top_k=3),
])
def test_bf16_matches_reference_within_bf16_rounding(case):
    if not _bf16_built():
        pytest.skip("this CPU has no AVX512-BF16: the bf16 experts are not built (the refusal test covers it)")
    for seed in range(2):
        x, weights, ids, w13, w2 = _case(**case, seed=seed, dtype=torch.bfloat16, width=BF16_WIDTH)
        exact = moe.moe_experts_reference(x.float(), weights, ids, w13.float(), w2.float())
        got = moe_cpu.moe_experts_cpp(x, weights, ids, w13, w2)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)
        torch_bf16 = moe.moe_experts_reference(x, weights, ids, w13, w2).float()
        assert (got.float() - exact).abs().mean() <= (torch_bf16 - exact).abs().mean()


@pytest.mark.parametrize("case", [
    dict(tokens=1, experts=16, top_k=4),  # one row: the one-token tiles
    dict(tokens=3, experts=8, top_k=2),  # runs of 1-3 rows: every remainder tile
    dict(tokens=16, experts=16, top_k=4, skip=(2, 9)),  # experts with no token
    dict(tokens=64, experts=8, top_k=2),  # runs longer than one 4-row tile
    dict(tokens=37, experts=5, top_k=3),  # 5 experts: weight-row blocks of 32 with a remainder
])
def test_matches_reference(case):
    for seed in range(2):
        x, weights, ids, w13, w2 = _case(**case, seed=seed)
        ref = moe.moe_experts_reference(x, weights, ids, w13, w2)
        got = moe_cpu.moe_experts_cpp(x, weights, ids, w13, w2)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.double(), _dense_wide(x, weights, ids, w13, w2, 0), atol=1e-5, rtol=1e-5)


def _dense_wide(x, weights, ids, w13, w2, first):
    """test_moe's every-expert float64 sum at this file's widths."""
    from tests.kernels import test_moe

    saved = test_moe.WIDTH
    test_moe.WIDTH = w2.shape[2]
    try:
        return _dense(x, weights, ids, w13, w2, first)
    finally:
        test_moe.WIDTH = saved


@pytest.mark.parametrize("first", [0, 3, 5])
def test_local_expert_range(first):
    x, weights, ids, w13, w2 = _case(20, 8, 2, seed=first)
    w13, w2 = w13[:3].contiguous(), w2[:3].contiguous()  # experts first .. first + 2 live here
    got = moe_cpu.moe_experts_cpp(x, weights, ids, w13, w2, first)
    torch.testing.assert_close(got, moe.moe_experts_reference(x, weights, ids, w13, w2, first), atol=1e-5,
                               rtol=1e-5)
    untouched = ~((ids >= first) & (ids < first + 3)).any(-1)
    assert untouched.any() and not got[untouched].any()


def test_no_tokens_and_no_local_pairs_give_zeros():
    x, weights, ids, w13, w2 = _case(4, 4, 2)
    assert moe_cpu.moe_experts_cpp(x[:0], weights[:0], ids[:0], w13, w2).shape == (0, HIDDEN)
    assert not moe_cpu.moe_experts_cpp(x, weights, ids, w13, w2, first_expert=10).any()


def test_registry_picks_it_for_decode_batches_and_says_why_not_elsewhere():
    x, weights, ids, w13, w2 = _case(16, 8, 2)
    with audit() as report:
        out = moe.moe_experts(x, weights, ids, w13, w2, site="test.moe_cpu")
    (entry,) = [e for e in report.entries if e.op == "moe_experts"]
    assert (entry.path, entry.refusals) == ("cpp", ())
    torch.testing.assert_close(out, moe.moe_experts_reference(x, weights, ids, w13, w2), atol=1e-5, rtol=1e-5)
    refusal = moe_cpu.moe_experts_cpp_supports
    limit = moe_cpu.max_pairs_per_expert(torch.float32)  # 32 eagerly; 64 inside a compiled step
    assert (limit, moe_cpu.max_pairs_per_expert(torch.float32, in_graph=True)) == (32, 64)
    assert refusal(*_case(limit * 8 // 2, 8, 2)) is None  # exactly the limit
    big = _case(limit * 8 // 2 + 1, 8, 2)  # one pair past the limit
    assert "above 32 an expert in torch.float32, BLAS GEMMs win" in refusal(*big)
    assert refusal(*_case(4, 8, 2, dtype=torch.bfloat16)) == \
        "hidden 64 and expert width 48 must be multiples of 32 in torch.bfloat16"
    bf16 = refusal(*_case(4, 8, 2, dtype=torch.bfloat16, width=BF16_WIDTH))
    assert bf16 is None if _bf16_built() else "need AVX512-BF16 (vdpbf16ps)" in bf16
    assert refusal(*_case(4, 8, 2, dtype=torch.float16)) == "expert weights dtype float16 not in (float32, bfloat16)"
    x, weights, ids, w13, w2 = _case(4, 8, 2, width=BF16_WIDTH)
    assert refusal(x, weights, ids, w13.to(torch.bfloat16), w2.to(torch.bfloat16)) == \
        "x dtype float32 not in (bfloat16)"
    assert "not contiguous" in refusal(x, weights, ids, w13.transpose(1, 2).contiguous().transpose(1, 2), w2)


def test_bad_input_is_an_error_not_a_crash():
    x, weights, ids, w13, w2 = _case(4, 8, 2)
    with pytest.raises(RuntimeError, match="float32"):
        moe_cpu.moe_experts_cpp(x.double(), weights, ids, w13, w2)
    with pytest.raises(RuntimeError, match="float32"):  # mixed dtypes
        moe_cpu.moe_experts_cpp(x.to(torch.bfloat16), weights, ids, w13, w2)
    with pytest.raises(RuntimeError, match="multiples of"):
        moe_cpu.moe_experts_cpp(x[:, :36], weights, ids, w13[..., :36].contiguous(), w2[:, :36].contiguous())


def test_a_compiled_layer_calls_it_instead_of_every_expert():
    """The MoE layer's trace choice: the C++ experts as one opaque op (not the folded every-expert GEMMs) for
    float32 stacks, and for bf16 stacks where the build has AVX512-BF16; the folded path again where the stack
    refuses (bf16 widths not multiples of 32); each equals the eager layer."""
    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, n_routed_experts=8,
                             num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                             norm_topk_prob=True, routed_scaling_factor=1.0)
    layer = MoE(config).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, HIDDEN ** -0.5)
    layer.pack_experts()
    assert layer._cpp_refusal is None
    x = torch.randn(4, HIDDEN)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    with torch.no_grad():
        eager = layer(x)
        torch.testing.assert_close(torch.compile(layer, fullgraph=True, backend=backend)(x), eager, atol=1e-5,
                                   rtol=1e-5)
    (graph,) = graphs
    targets = {str(node.target) for node in graph.graph.nodes}
    assert "metainfer.moe_experts.default" in targets or "metainfer.moe_experts" in targets, targets
    bf16 = MoE(config).to(torch.bfloat16)
    bf16.pack_experts()
    assert bf16._cpp_refusal == "hidden 64 and expert width 48 must be multiples of 32 in torch.bfloat16"
    assert not bf16._cpp_in_graph(x.to(torch.bfloat16), torch.zeros(4, 2, dtype=torch.long))
    wide = MoE(SimpleNamespace(**{**vars(config), "moe_intermediate_size": BF16_WIDTH})).to(torch.bfloat16).eval()
    wide.pack_experts()
    assert wide._cpp_in_graph(x.to(torch.bfloat16), torch.zeros(4, 2, dtype=torch.long)) == _bf16_built()
