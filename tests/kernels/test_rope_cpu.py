"""The C++ CPU rotary embedding against the torch reference, bit for bit: float32 and bf16 x, float32 and bf16
tables, interleaved and half-split pairs, head widths with a tail past the vector width, leading batch dimensions,
zero tokens; the refusals and the registry's choice for token counts no compiled graph was built for."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import audit, rotary, rotary_cpu
from tests.kernels.conftest import DTYPES, require_cpu_kernel


@pytest.fixture(scope="module", autouse=True)
def built():
    require_cpu_kernel(rotary_cpu.warm_up)


def _tables(seq: int, dim: int, dtype: torch.dtype):
    angles = torch.rand(seq, dim // 2) * 6.28
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(300, 8, 64), (7, 1, 64), (2, 9, 3, 6), (1, 40, 3, 96), (17, 2, 34), (0, 4, 64)])
def test_matches_reference_bit_for_bit(dtype, table_dtype, interleaved, shape):
    x = torch.randn(shape).to(dtype) * 4
    cos, sin = _tables(shape[-3], shape[-1], table_dtype)
    out = rotary_cpu.rope_cpp(x, cos, sin, interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, rotary.rope_reference(x, cos, sin, interleaved))  # products rounded, no fused add


def test_refusals_name_what_is_wrong():
    x = torch.randn(5, 2, 8)
    cos, sin = _tables(5, 8, torch.float32)
    assert "dtype" in rotary_cpu.rope_cpp_supports(x.half(), cos, sin, True)
    assert "sin dtype" in rotary_cpu.rope_cpp_supports(x, cos, sin.bfloat16(), True)
    assert "not contiguous" in rotary_cpu.rope_cpp_supports(torch.randn(5, 2, 16)[..., :8], cos, sin, True)
    assert "not contiguous" in rotary_cpu.rope_cpp_supports(x, torch.randn(4, 5).t(), sin, True)
    with torch.enable_grad():
        assert "grad" in rotary_cpu.rope_cpp_supports(x.requires_grad_(), cos, sin, True)
    assert rotary_cpu.rope_cpp_supports(torch.randn(5, 2, 8), cos, sin, False) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_takes_the_cpp_path_for_any_token_count(no_interpret, dtype):
    with audit() as report:
        for tokens in (3, 61, 700):
            x = torch.randn(tokens, 8, 64).to(dtype)
            cos, sin = _tables(tokens, 64, torch.float32)
            out = rotary.rope(x, cos, sin, interleaved=True, site="tokens")
            assert torch.equal(out, rotary.rope_reference(x, cos, sin, True))
    assert report.paths() == {"rope": {"cpp": 3}}
