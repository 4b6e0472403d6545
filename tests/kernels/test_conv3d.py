"""conv3d: the oneDNN path equals torch's conv3d, refuses with reasons, and the fused Wan VAE decodes the same."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import audit, conv
from metainfer_gen.video.fuse import FuseKernelsConfig, fuse_kernels, unfuse_kernels
from metainfer_gen.kernels.conv import CONV3D, conv3d, conv3d_reference
from tests.kernels.conftest import assert_close

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

CASES = [  # (x shape, weight shape, stride, padding, dilation, groups, bias)
    ((1, 8, 4, 10, 10), (6, 8, 3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1), 1, True),
    ((2, 4, 5, 9, 7), (4, 2, 3, 1, 3), (1, 2, 1), (1, 0, 1), (1, 1, 2), 2, False),
    ((1, 3, 3, 8, 8), (5, 3, 1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1), 1, True),
]


@onednn
@pytest.mark.parametrize("case", CASES)
def test_onednn_path_matches_torch_conv3d(case):
    x_shape, w_shape, stride, padding, dilation, groups, with_bias = case
    x, weight = torch.randn(x_shape), torch.randn(w_shape)
    bias = torch.randn(w_shape[0]) if with_bias else None
    expected = conv3d_reference(x, weight, bias, stride, padding, dilation, groups)
    with audit() as report:
        got = conv3d(x, weight, bias, stride, padding, dilation, groups, site="test")
    assert report.paths() == {"conv3d": {"onednn": 1}}
    assert_close(got, expected)


def test_the_video_vae_shape_is_one_pytorch_sends_to_its_slow_path():
    """Why the op exists: PyTorch's rule picks slow_conv3d for this (one latent frame of the embedded decoder)."""
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None:
        pytest.skip("torch._C._select_conv_backend not in this torch")
    (x, weight, bias, stride, padding, dilation, groups), _ = CONV3D.example("cpu", torch.float32)
    backend = select(x, weight, bias, list(stride), list(padding), list(dilation), False, [0, 0, 0], groups, None)
    assert "Slow3d" in str(backend), f"PyTorch now picks {backend}: the onednn path may be unneeded"


@onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_take_the_onednn_call_pytorch_makes_bit_for_bit(dtype):
    if not conv.onednn_supports_dtype(dtype):
        pytest.skip(f"this CPU has no oneDNN {dtype} convolution (the refusal test covers it)")
    (x, weight, bias, stride, padding, dilation, groups), _ = CONV3D.example("cpu", dtype)
    with audit() as report:
        got = conv3d(x, weight, bias, stride, padding, dilation, groups, site="test")
    assert report.paths() == {"conv3d": {"onednn": 1}}
    assert torch.equal(got, conv3d_reference(x, weight, bias, stride, padding, dilation, groups))


def test_a_cpu_without_onednn_bf16_or_fp16_is_refused_with_what_it_lacks(monkeypatch):
    monkeypatch.setattr(conv, "onednn_supports_dtype", lambda dtype: dtype == torch.float32)
    for dtype, lacks in ((torch.bfloat16, "avx512bw"), (torch.float16, "avx512_fp16")):
        x, weight = torch.randn(1, 2, 3, 5, 5, dtype=dtype), torch.randn(2, 2, 3, 3, 3, dtype=dtype)
        impl, refusals = CONV3D.select(x, weight, None, (1, 1, 1), (0, 0, 0), (1, 1, 1), 1)
        assert impl.name == "torch" and refusals[0].implementation == "onednn" and lacks in refusals[0].reason


@pytest.mark.parametrize("dtype, needs_grad, reason", [
    (torch.float64, False, "oneDNN convolves float32, bfloat16 or float16"),
    (torch.float32, True, "autograd"),
])
def test_refusals_say_why(dtype, needs_grad, reason):
    x = torch.randn(1, 2, 3, 5, 5, dtype=dtype, requires_grad=needs_grad)
    weight = torch.randn(2, 2, 3, 3, 3, dtype=dtype)
    _, refusals = CONV3D.select(x, weight, None, (1, 1, 1), (0, 0, 0), (1, 1, 1), 1)
    assert refusals and refusals[0].implementation == "onednn" and reason in refusals[0].reason
    expected = conv3d_reference(x, weight, None, (1, 1, 1), (0, 0, 0), (1, 1, 1), 1)
    assert_close(conv3d(x, weight), expected, torch.float32)  # the torch path in x's dtype (float64 too)


def test_bad_shapes_raise_before_any_work():
    with pytest.raises(ValueError, match=r"\(N, C, D, H, W\)"):
        conv3d(torch.randn(2, 3, 4, 4), torch.randn(2, 2, 3, 3, 3))
    with pytest.raises(ValueError, match="stride must be"):
        conv3d(torch.randn(1, 2, 3, 5, 5), torch.randn(2, 2, 3, 3, 3), stride=(1, 1))


@onednn
def test_fused_wan_vae_decodes_as_the_stock_one_and_unfuses_exactly():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           attn_scales=[]).eval()
    z = torch.randn(1, 4, 3, 4, 4)
    with torch.no_grad():
        reference = vae.decode(z).sample
        report = fuse_kernels(vae, FuseKernelsConfig(channel_norm=False, upsample=False))  # the convolutions alone
        assert report.num_fused == sum(type(m).__name__ == "WanCausalConv3d" for m in vae.modules()) > 0
        with audit() as log:
            fused = vae.decode(z).sample
        assert set(log.paths()) == {"conv3d"} and set(log.paths()["conv3d"]) == {"onednn"}
        assert_close(fused, reference)
        assert unfuse_kernels(vae) == report.num_fused
        assert torch.equal(vae.decode(z).sample, reference)


def test_conv3d_is_exported_lazily():
    from metainfer_gen import kernels

    assert kernels.conv3d is conv3d
