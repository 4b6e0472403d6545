"""channel_rms_norm: the sum-of-squares path equals F.normalize's, errors are clear, and the fused Wan VAE (convs
and norms) decodes as the stock one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metainfer_gen.kernels import audit
from metainfer_gen.video.fuse import fuse_kernels, unfuse_kernels
from metainfer_gen.kernels.channel_norm import CHANNEL_RMS_NORM, channel_rms_norm, channel_rms_norm_reference
from tests.kernels.conftest import assert_close


@pytest.mark.parametrize("shape, gamma_shape, with_bias", [
    ((1, 8, 3, 6, 5), (8, 1, 1, 1), False),  # Wan VAE residual block (3-D)
    ((2, 4, 7, 7), (4, 1, 1), True),  # Wan VAE attention block (per frame, 2-D)
    ((3, 5), (5,), True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sumsq_path_matches_f_normalize(shape, gamma_shape, with_bias, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    gamma = torch.rand(gamma_shape, dtype=dtype) + 0.5
    bias = torch.randn(gamma_shape, dtype=dtype) if with_bias else 0.0
    # What diffusers' WanRMS_norm computes, written out.
    expected = F.normalize(x.float(), dim=1).to(dtype) * shape[1] ** 0.5 * gamma + bias
    with audit() as report:
        got = channel_rms_norm(x, gamma, bias, site="test")
    assert report.paths() == {"channel_rms_norm": {"sumsq": 1}}
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, expected)
    assert_close(channel_rms_norm_reference(x, gamma, bias, 1e-12), expected)


def test_gradients_match_the_reference():
    torch.manual_seed(1)
    x = torch.randn(2, 6, 3, 5, requires_grad=True)
    gamma = (torch.rand(6, 1, 1) + 0.5).requires_grad_()
    bias = torch.randn(6, 1, 1, requires_grad=True)
    grads = []
    for fn in (channel_rms_norm, lambda *a: channel_rms_norm_reference(*a, 1e-12)):
        x.grad = gamma.grad = bias.grad = None
        (fn(x, gamma, bias) * torch.linspace(-1, 1, 5)).sum().backward()
        grads.append((x.grad.clone(), gamma.grad.clone(), bias.grad.clone()))
    for got, want in zip(*grads):
        assert_close(got, want)


def test_zero_vector_stays_finite_like_f_normalize():
    x = torch.zeros(1, 4, 2, 2)
    got = channel_rms_norm(x, torch.ones(4, 1, 1))
    assert torch.equal(got, F.normalize(x, dim=1) * 2.0)


def test_bad_inputs_raise_before_any_work():
    with pytest.raises(ValueError, match=r"floating \(N, C, ...\)"):
        channel_rms_norm(torch.ones(4), torch.ones(1))
    with pytest.raises(ValueError, match=r"floating \(N, C, ...\)"):
        channel_rms_norm(torch.ones(2, 3, dtype=torch.int64), torch.ones(3))
    with pytest.raises(ValueError, match="one scale per channel \\(3\\)"):
        channel_rms_norm(torch.randn(2, 3, 4), torch.ones(4, 1))


def test_registered_with_the_reference_last():
    assert [impl.name for impl in CHANNEL_RMS_NORM.implementations] == ["sumsq", "torch"]


def test_fused_wan_vae_with_attention_decodes_as_the_stock_one():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           attn_scales=[]).eval()
    z = torch.randn(1, 4, 3, 4, 4)
    norms = [n for n, m in vae.named_modules() if type(m).__name__ == "WanRMS_norm"]
    with torch.no_grad():
        reference = vae.decode(z).sample
        report = fuse_kernels(vae)
        assert set(norms) <= set(report.fused) and norms
        with audit() as log:
            fused = vae.decode(z).sample
        assert {"channel_rms_norm", "conv3d"} <= set(log.paths())
        assert_close(fused, reference)
        unfuse_kernels(vae)
        assert torch.equal(vae.decode(z).sample, reference)


def test_channel_rms_norm_is_exported_lazily():
    from metainfer_gen import kernels

    assert kernels.channel_rms_norm is channel_rms_norm
