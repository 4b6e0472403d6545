"""Prefill attention over one block of keys: every path against the whole-matrix reference, and the path choice."""

import pytest
import torch

from metainfer_gen import platform
from metainfer_gen.kernels import block_attention as ba
from metainfer_gen.kernels.audit_log import audit
from metainfer_gen.kernels.cpu_build import load_built
from metainfer_gen.llm import attention_chunks
from tests.kernels.conftest import require_cpu_kernel

BF16_CPU = platform.Capabilities(device_kind=platform.DeviceKind.CPU, bf16=True, cpu_matrix="avx512_bf16",
                                 cpu_capability="AVX512")
PLAIN_CPU = platform.Capabilities(device_kind=platform.DeviceKind.CPU, bf16=False, cpu_matrix="",
                                  cpu_capability="AVX512")


def _inputs(t, s, dtype, seed=0):
    torch.manual_seed(seed)
    q, k = torch.randn(4, t, 24, dtype=dtype), torch.randn(4, s, 24, dtype=dtype)
    return q, k, torch.randn(4, s, 16, dtype=dtype)  # v narrower than q and k, as MLA's


def _masks(t, s):
    mask = torch.rand(t, s, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[2] = False  # a query that sees no key of this block: lse -inf, output 0
    return [dict(), dict(causal=True), dict(mask=mask)]


PATHS = [(impl, dtype) for impl in ("bmm-fused", "bmm-blocks", "flash-cpu")
         for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("impl,dtype", PATHS, ids=[f"{i}-{str(d)[6:]}" for i, d in PATHS])
@pytest.mark.parametrize("t,s", [(9, 13), (300, 300), (300, 170), (140, 420)])
def test_each_path_equals_the_whole_matrix(impl, dtype, t, s):
    """Query blocks of 128 split the 300- and 140-query cases, causal with fewer and with more keys than queries;
    float32 to 1e-5, bf16 to its rounding of scores and probabilities."""
    q, k, v = _inputs(t, s, dtype)
    fn = ba.BLOCK_ATTENTION.implementation(impl).fn
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for kwargs in _masks(t, s):
        out, lse = fn(q, k, v, 0.3, **kwargs)
        ref_out, ref_lse = ba.block_attention_reference(q.float(), k.float(), v.float(), 0.3, **kwargs)
        assert out.dtype == dtype and out.shape == (4, t, 16) and lse.dtype == torch.float32
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen)
        torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=0, atol=tol)
        torch.testing.assert_close(out.float(), ref_out, rtol=0, atol=tol)
        if "mask" in kwargs:
            assert torch.isinf(lse[:, 2]).all() and (out[:, 2] == 0).all()


def test_the_path_follows_the_dtype_and_the_cpu_flags():
    """bf16 takes the fused softmax only where bf16 GEMMs are native; float32 takes it on every CPU."""
    require_cpu_kernel(lambda: load_built("block_softmax")[1])
    q, k, v = _inputs(16, 16, torch.bfloat16)
    for caps in (BF16_CPU, PLAIN_CPU):
        with platform.override_capabilities(caps):
            assert ba.BLOCK_ATTENTION.select(q.float(), k.float(), v.float(), 0.3) == \
                (ba.BLOCK_ATTENTION.implementation("bmm-fused"), ())
    with platform.override_capabilities(BF16_CPU):
        assert ba.BLOCK_ATTENTION.select(q, k, v, 0.3)[0].name == "bmm-fused"
        refusal = ba.BLOCK_ATTENTION.select(q, k.float(), v, 0.3)[1][0]
        assert refusal.implementation == "bmm-fused" and "one dtype" in refusal.reason
    with platform.override_capabilities(PLAIN_CPU):
        impl, refusals = ba.BLOCK_ATTENTION.select(q, k, v, 0.3)
        assert impl.name == "flash-cpu" and all("emulate" in r.reason for r in refusals)


def test_the_fused_softmax_switched_off_leaves_the_torch_softmax(monkeypatch):
    from metainfer_gen.kernels.cpu_build import DISABLE_ENV

    q, k, v = _inputs(16, 16, torch.bfloat16)
    monkeypatch.setenv(DISABLE_ENV, "0")
    with platform.override_capabilities(BF16_CPU):
        impl, (refusal,) = ba.BLOCK_ATTENTION.select(q, k, v, 0.3)
    assert impl.name == "bmm-blocks" and DISABLE_ENV in refusal.reason


def test_the_fused_softmax_matches_the_torch_softmax_to_float32_rounding():
    """Both paths round the scores and probabilities to bf16 at the same points; only the exp and the summation
    order differ (a few float32 ulps in the LSE)."""
    q, k, v = _inputs(300, 300, torch.bfloat16, seed=5)
    for kwargs in _masks(300, 300):
        out, lse = ba._bmm_fused(q, k, v, 0.3, **kwargs)
        ref_out, ref_lse = ba._bmm_blocks(q, k, v, 0.3, **kwargs)
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen)
        torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=0, atol=1e-5)
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=0, atol=8e-3)  # one bf16 ulp near 1


def test_dispatch_is_audited_and_checks_shapes():
    q, k, v = _inputs(8, 8, torch.float32)
    with audit() as report:
        ba.block_attention(q, k, v, 0.3, causal=True, site="test.prefill")
    assert any(e.site == "test.prefill" and e.op == "block_attention" for e in report.entries)
    with pytest.raises(ValueError, match="not both"):
        ba.block_attention(q, k, v, 0.3, torch.ones(8, 8, dtype=torch.bool), causal=True)
    with pytest.raises(ValueError, match="block_attention needs"):
        ba.block_attention(q, k[:, :, :8], v, 0.3)


def test_the_planner_reads_the_kernels_query_block():
    assert attention_chunks.QUERY_BLOCK == ba.QUERY_BLOCK
