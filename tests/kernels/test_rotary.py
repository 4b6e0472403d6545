"""Rotary embedding, interleaved and half-split: reference against independent formulas, kernels against it."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import rotary
from tests.kernels.conftest import DTYPES, assert_close, requires_cuda

SHAPES = [(1, 6, 2, 8), (2, 5, 3, 16), (4, 2, 12)]  # (B, S, H, D) and an LLM batch (T, H, D)


def _tables(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(seq, dim // 2) * 6.28
    return angles.cos(), angles.sin()


def test_interleaved_reference_matches_diffusers_wan_processor():
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    rope_module = WanRotaryPosEmbed(attention_head_dim=12, patch_size=(1, 2, 2), max_seq_len=64)
    freqs_cos, freqs_sin = rope_module(torch.randn(1, 4, 2, 4, 6))  # (1, S, 1, D) repeated per pair
    x = torch.randn(2, freqs_cos.shape[1], 3, 12, dtype=torch.bfloat16)
    # WanAttnProcessor.apply_rotary_emb, verbatim
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    expected = torch.empty_like(x)
    expected[..., 0::2] = x1 * cos - x2 * sin
    expected[..., 1::2] = x1 * sin + x2 * cos
    got = rotary.rope_reference(x, freqs_cos[0, :, 0, 0::2].float(), freqs_sin[0, :, 0, 1::2].float(), True)
    assert_close(got, expected.type_as(x))


def test_half_split_reference_matches_rotate_half_formula():
    x = torch.randn(5, 4, 16)
    cos, sin = _tables(5, 16)
    cos_full, sin_full = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    rotate_half = torch.cat([-x[..., 8:], x[..., :8]], -1)  # transformers' rotate_half
    assert_close(rotary.rope_reference(x, cos, sin, False), x * cos_full + rotate_half * sin_full)


def test_rotation_preserves_pair_norms():
    x = torch.randn(3, 2, 8)
    cos, sin = _tables(3, 8)
    out = rotary.rope_reference(x, cos, sin, True)
    torch.testing.assert_close(out.unflatten(-1, (-1, 2)).norm(dim=-1), x.unflatten(-1, (-1, 2)).norm(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_triton_rope_matches_reference(interpret, shape, dtype, interleaved):
    x = torch.randn(shape, dtype=dtype)
    cos, sin = _tables(shape[-3], shape[-1])
    assert_close(rotary.rope_triton(x, cos, sin, interleaved), rotary.rope_reference(x, cos, sin, interleaved))


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_rope_matches_reference(dtype):
    x = torch.randn(2, 6, 3, 16, dtype=dtype)
    cos, sin = _tables(6, 16)
    compiled = rotary.ROPE.implementation("compiled")
    for interleaved in (True, False):
        assert_close(compiled(x, cos, sin, interleaved), rotary.rope_reference(x, cos, sin, interleaved))


def test_public_rope_validates_shapes(no_interpret):
    x = torch.randn(1, 4, 2, 8)
    cos, sin = _tables(4, 8)
    assert_close(rotary.rope(x, cos, sin, interleaved=False), rotary.rope_reference(x, cos, sin, False))
    with pytest.raises(ValueError, match="even"):
        rotary.rope(torch.randn(1, 4, 2, 7), cos, sin, interleaved=True)
    with pytest.raises(ValueError, match=r"cos shape \(3, 4\)"):
        rotary.rope(x, cos[:3], sin, interleaved=True)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_triton_rope_matches_reference(dtype):
    x = torch.randn(2, 1024, 12, 128, device="cuda", dtype=dtype)
    cos, sin = (t.cuda() for t in _tables(1024, 128))
    for interleaved in (True, False):
        assert rotary.ROPE.select(x, cos, sin, interleaved)[0].name == "triton"
        assert_close(rotary.rope(x, cos, sin, interleaved=interleaved),
                     rotary.rope_reference(x, cos, sin, interleaved))
