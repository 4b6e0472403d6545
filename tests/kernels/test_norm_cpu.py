"""The C++ CPU RMSNorm and fused residual-add + RMSNorm against the torch reference: float32 and bf16, with and without
a weight, row counts no compiled graph was built for, widths that leave a tail past the vector width, zero rows, the
refusals (dtype, strides, autograd) and the registry's choice. Tolerances: tests/kernels/conftest.py's TOL."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import audit, norm, norm_cpu
from tests.kernels.conftest import DTYPES, assert_close, require_cpu_kernel


@pytest.fixture(scope="module", autouse=True)
def built():
    require_cpu_kernel(norm_cpu.warm_up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 384), (37, 512), (5, 3, 70), (0, 64), (300, 1536)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_reference(dtype, shape, with_weight):
    x = torch.randn(shape).to(dtype) * 3
    w = torch.randn(shape[-1]).to(dtype) if with_weight else None
    assert_close(norm_cpu.rms_norm_cpp(x, w, 1e-6), norm.rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_forms_read_a_column_slice_in_place(dtype):
    rows = torch.randn(33, 576).to(dtype)
    c_kv = rows[:, :512]  # MLA's latent half of kv_a_proj's output: rows 576 apart
    w = torch.randn(512).to(dtype)
    assert norm_cpu.rms_norm_cpp_supports(c_kv, w, 1e-6) is None
    out = norm_cpu.rms_norm_cpp(c_kv, w, 1e-6)
    assert out.is_contiguous()
    assert_close(out, norm.rms_norm_reference(c_kv, w, 1e-6))
    residual = torch.randn(33, 512).to(dtype)
    assert norm_cpu.fused_add_rms_norm_cpp_supports(c_kv, residual, w, 1e-6) is None
    fused, summed = norm_cpu.fused_add_rms_norm_cpp(c_kv, residual, w, 1e-6)
    ref_fused, ref_sum = norm.fused_add_rms_norm_reference(c_kv, residual, w, 1e-6)
    assert torch.equal(summed, ref_sum)
    assert_close(fused, ref_fused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 384), (129, 200), (0, 32)])
def test_fused_add_rms_norm_matches_reference_and_stores_the_rounded_sum(dtype, shape):
    x, r = (torch.randn(shape).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1]).to(dtype)
    out, summed = norm_cpu.fused_add_rms_norm_cpp(x, r, w, 1e-5)
    ref_out, ref_sum = norm.fused_add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(summed, ref_sum)  # one rounding of an exact float32 sum, as the reference
    assert_close(out, ref_out)


def test_refusals_name_what_is_wrong():
    x = torch.randn(4, 64)
    assert "dtype" in norm_cpu.rms_norm_cpp_supports(x.half(), None, 1e-6)
    assert "weight dtype" in norm_cpu.rms_norm_cpp_supports(x.bfloat16(), torch.ones(64), 1e-6)
    assert "not contiguous" in norm_cpu.rms_norm_cpp_supports(x.t(), None, 1e-6)  # column stride 64
    assert "not contiguous" in norm_cpu.rms_norm_cpp_supports(torch.randn(2, 4, 64)[:, :, :32], None, 1e-6)
    assert "residual dtype" in norm_cpu.fused_add_rms_norm_cpp_supports(x, x.bfloat16(), None, 1e-6)
    with torch.enable_grad():
        assert "grad" in norm_cpu.rms_norm_cpp_supports(x.requires_grad_(), None, 1e-6)
    assert norm_cpu.rms_norm_cpp_supports(torch.randn(4, 64), torch.ones(64), 1e-6) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_takes_the_cpp_path_for_any_row_count(no_interpret, dtype):
    w = torch.randn(96).to(dtype)
    with audit() as report:
        for rows in (3, 17, 1000):
            x = torch.randn(rows, 96).to(dtype)
            assert_close(norm.rms_norm(x, w, 1e-6, site="rows"), norm.rms_norm_reference(x, w, 1e-6))
            out, _ = norm.fused_add_rms_norm(x, x, w, 1e-6, site="rows")
            assert_close(out, norm.fused_add_rms_norm_reference(x, x, w, 1e-6)[0])
    assert report.paths() == {"rms_norm": {"cpp": 3}, "fused_add_rms_norm": {"cpp": 3}}
