"""adaLN modulate and gated residual: reference against diffusers' Wan block formulas, kernels against it."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import adaln
from tests.kernels.conftest import DTYPES, assert_close, requires_cuda


def _wan_modulation(batch: int, seq: int, dim: int, per_token: bool) -> list[torch.Tensor]:
    """The six float32 (shift, scale, gate, c_shift, c_scale, c_gate) views a Wan block makes from temb."""
    table = torch.randn(1, 6, dim) / dim**0.5
    if per_token:  # Wan 2.2 TI2V: (B, S, 6, N)
        return [m.squeeze(2) for m in (table.unsqueeze(0) + torch.randn(batch, seq, 6, dim)).chunk(6, dim=2)]
    return list((table + torch.randn(batch, 6, dim)).chunk(6, dim=1))  # (B, 1, N) each


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_the_wan_block_formula(dtype):
    from diffusers.models.normalization import FP32LayerNorm

    x = torch.randn(2, 5, 32, dtype=dtype)
    shift, scale, gate, *_ = _wan_modulation(2, 5, 32, per_token=False)
    norm1 = FP32LayerNorm(32, 1e-6, elementwise_affine=False)
    expected = (norm1(x.float()) * (1 + scale) + shift).type_as(x)
    assert_close(adaln.adaln_modulate_reference(x, scale, shift, 1e-6), expected)
    y = torch.randn(2, 5, 32, dtype=dtype)
    assert_close(adaln.gated_residual_reference(x, y, gate), (x.float() + y * gate).type_as(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,seq,dim,per_token", [(1, 6, 32, False), (2, 5, 48, False), (2, 4, 40, True)])
def test_triton_adaln_modulate_matches_reference(interpret, batch, seq, dim, per_token, dtype):
    x = torch.randn(batch, seq, dim, dtype=dtype) * 2 + 0.5
    shift, scale, *_ = _wan_modulation(batch, seq, dim, per_token)
    if per_token:
        assert not scale.is_contiguous()  # the kernel must follow the strides of the chunked table
    assert_close(adaln.adaln_modulate_triton(x, scale, shift, 1e-6),
                 adaln.adaln_modulate_reference(x, scale, shift, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,seq,dim,per_token", [(1, 6, 32, False), (2, 5, 48, False), (2, 4, 40, True)])
def test_triton_gated_residual_matches_reference(interpret, batch, seq, dim, per_token, dtype):
    r, y = torch.randn(batch, seq, dim, dtype=dtype), torch.randn(batch, seq, dim, dtype=dtype)
    gate = _wan_modulation(batch, seq, dim, per_token)[2]
    assert_close(adaln.gated_residual_triton(r, y, gate), adaln.gated_residual_reference(r, y, gate))


def test_triton_takes_two_dimensional_rows_with_a_shared_scale(interpret):
    x = torch.randn(7, 24)
    scale, shift = torch.randn(24), torch.randn(1, 24)
    assert_close(adaln.adaln_modulate_triton(x, scale, shift, 1e-5),
                 adaln.adaln_modulate_reference(x, scale, shift, 1e-5))
    assert_close(adaln.gated_residual_triton(x, x.flip(0).contiguous(), scale),
                 adaln.gated_residual_reference(x, x.flip(0), scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_paths_match_reference(dtype):
    x, y = torch.randn(2, 8, 64, dtype=dtype), torch.randn(2, 8, 64, dtype=dtype)
    shift, scale, gate, *_ = _wan_modulation(2, 8, 64, per_token=False)
    assert_close(adaln.ADALN_MODULATE.implementation("compiled")(x, scale, shift, 1e-6),
                 adaln.adaln_modulate_reference(x, scale, shift, 1e-6))
    assert_close(adaln.GATED_RESIDUAL.implementation("compiled")(x, y, gate),
                 adaln.gated_residual_reference(x, y, gate))


def test_public_functions_validate_broadcasting(no_interpret):
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="scale shape"):
        adaln.adaln_modulate(x, torch.randn(3, 3, 8), torch.randn(8))
    with pytest.raises(ValueError, match="last dim 8"):
        adaln.adaln_modulate(x, torch.randn(2, 1, 4), torch.randn(8))
    with pytest.raises(ValueError, match="y shape"):
        adaln.gated_residual(x, torch.randn(2, 3, 7), torch.randn(8))
    out = adaln.gated_residual(x, x, torch.randn(2, 1, 8))
    assert out.shape == x.shape


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_triton_adaln_matches_reference(dtype):
    x, y = torch.randn(2, 1024, 1536, device="cuda", dtype=dtype), torch.randn(2, 1024, 1536, device="cuda",
                                                                                dtype=dtype)
    shift, scale, gate, *_ = (m.cuda() for m in _wan_modulation(2, 1024, 1536, per_token=True))
    assert adaln.ADALN_MODULATE.select(x, scale, shift, 1e-6)[0].name == "triton"
    assert_close(adaln.adaln_modulate(x, scale, shift), adaln.adaln_modulate_reference(x, scale, shift, 1e-6))
    assert_close(adaln.gated_residual(x, y, gate), adaln.gated_residual_reference(x, y, gate))
