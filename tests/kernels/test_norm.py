"""RMSNorm and fused residual-add + RMSNorm: Triton (interpreted), compiled and dispatch against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metainfer_gen.kernels import norm
from tests.kernels.conftest import DTYPES, assert_close, requires_cuda

SHAPES = [(3, 64), (2, 5, 100), (1, 7, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_torch_rms_norm_in_float32(dtype):
    x = torch.randn(4, 96, dtype=dtype)
    w = torch.randn(96, dtype=dtype)
    expected = F.rms_norm(x.float(), (96,), w.float(), eps=1e-6).to(dtype)
    assert_close(norm.rms_norm_reference(x, w, 1e-6), expected)


def test_fused_reference_normalises_the_rounded_sum_like_a_decoder_layer():
    x, r = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    summed = x + r  # bf16 add: float32 then one rounding, as in Hugging Face decoder layers
    out, res = norm.fused_add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(res, summed)
    assert torch.equal(out, norm.rms_norm_reference(summed, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_triton_rms_norm_matches_reference(interpret, shape, dtype, with_weight):
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype) if with_weight else None
    assert_close(norm.rms_norm_triton(x, w, 1e-6), norm.rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_fused_add_rms_norm_matches_reference(interpret, shape, dtype):
    x, r = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=torch.float32)
    out, res = norm.fused_add_rms_norm_triton(x, r, w, 1e-5)
    ref_out, ref_res = norm.fused_add_rms_norm_reference(x, r, w, 1e-5)
    assert_close(res, ref_res)
    assert_close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_paths_match_reference(dtype):
    x, r = torch.randn(6, 128, dtype=dtype), torch.randn(6, 128, dtype=dtype)
    w = torch.randn(128, dtype=dtype)
    compiled = norm.RMS_NORM.implementation("compiled")
    assert_close(compiled(x, w, 1e-6), norm.rms_norm_reference(x, w, 1e-6))
    fused = norm.FUSED_ADD_RMS_NORM.implementation("compiled")
    for got, want in zip(fused(x, r, w, 1e-6), norm.fused_add_rms_norm_reference(x, r, w, 1e-6)):
        assert_close(got, want)


def test_public_rms_norm_uses_torch_eps_default_and_checks_shapes(no_interpret):
    x = torch.randn(2, 32)
    expected = norm.rms_norm_reference(x, None, torch.finfo(torch.float32).eps)
    assert_close(norm.rms_norm(x), expected)
    with pytest.raises(ValueError, match="weight shape"):
        norm.rms_norm(x, torch.ones(31))
    with pytest.raises(TypeError, match="floating"):
        norm.rms_norm(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="residual shape"):
        norm.fused_add_rms_norm(x, torch.randn(2, 31))


def test_dispatch_takes_the_compiled_path_above_the_size_threshold_and_it_agrees(no_interpret, monkeypatch):
    from metainfer_gen.kernels import audit

    monkeypatch.setenv("METAINFER_CPU_KERNELS", "0")  # the C++ kernel, first where it builds, off

    x = torch.randn(1024, 1024)  # 2**20 elements: exactly the threshold
    w = torch.randn(1024)
    with audit() as report:
        out = norm.rms_norm(x, w, 1e-6, site="big")
        small = norm.rms_norm(x[:2], w, 1e-6, site="small")
    assert report.paths() == {"rms_norm": {"compiled": 1, "torch": 1}}
    assert_close(out, norm.rms_norm_reference(x, w, 1e-6))
    assert_close(small, norm.rms_norm_reference(x[:2], w, 1e-6))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_triton_rms_norm_matches_reference(dtype):
    x, r = torch.randn(37, 4096, device="cuda", dtype=dtype), torch.randn(37, 4096, device="cuda", dtype=dtype)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    assert norm.RMS_NORM.select(x, w, 1e-6)[0].name == "triton"
    assert_close(norm.rms_norm(x, w, 1e-6), norm.rms_norm_reference(x, w, 1e-6))
    for got, want in zip(norm.fused_add_rms_norm(x, r, w, 1e-6), norm.fused_add_rms_norm_reference(x, r, w, 1e-6)):
        assert_close(got, want)
