"""upsample_nearest: the repeat path equals diffusers' float32 interpolate bit for bit, refuses with reasons, errors
are clear, and the fused Wan VAE decodes as the stock one."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import audit
from metainfer_gen.kernels.upsample import UPSAMPLE_NEAREST, upsample_nearest, upsample_nearest_reference
from metainfer_gen.video.fuse import FuseKernelsConfig, fuse_kernels, unfuse_kernels


@pytest.mark.parametrize("shape, scale", [((4, 8, 5, 7), (2, 2)), ((1, 3, 4, 4), (3, 1)), ((2, 2, 1, 6), (1, 2))])
@pytest.mark.parametrize("mode", ["nearest-exact", "nearest"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_repeat_path_equals_the_reference_exactly(shape, scale, mode, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    with audit() as report:
        got = upsample_nearest(x, scale, mode, site="test")
    assert report.paths() == {"upsample_nearest": {"repeat": 1}}
    assert got.dtype == dtype and got.shape == (shape[0], shape[1], shape[2] * scale[0], shape[3] * scale[1])
    assert torch.equal(got, upsample_nearest_reference(x, scale, mode))


def test_autograd_keeps_the_reference_path():
    x = torch.randn(1, 2, 3, 3, requires_grad=True)
    with audit() as report:
        upsample_nearest(x).sum().backward()
    assert report.paths() == {"upsample_nearest": {"torch": 1}}
    assert torch.equal(x.grad, torch.full_like(x, 4.0))


def test_bad_inputs_raise_before_any_work():
    with pytest.raises(ValueError, match=r"floating \(N, C, H, W\)"):
        upsample_nearest(torch.randn(1, 2, 3, 3, 3))
    with pytest.raises(ValueError, match="two positive integers"):
        upsample_nearest(torch.randn(1, 2, 3, 3), (1.5, 2))
    with pytest.raises(ValueError, match="mode must be one of"):
        upsample_nearest(torch.randn(1, 2, 3, 3), (2, 2), "bilinear")


def test_registered_with_the_reference_last():
    assert [impl.name for impl in UPSAMPLE_NEAREST.implementations] == ["repeat", "torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_wan_vae_upsamplers_decode_as_the_stock_ones_and_unfuse(dtype):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[True, False], attn_scales=[]).eval().to(dtype)
    z = torch.randn(1, 4, 3, 4, 4, dtype=dtype)
    only = FuseKernelsConfig(conv3d=False, channel_norm=False)  # the upsamplers alone
    with torch.no_grad():
        reference = vae.decode(z).sample
        report = fuse_kernels(vae, only)
        assert report.num_fused == sum(type(m).__name__ == "WanUpsample" for m in vae.modules()) > 0
        with audit() as log:
            fused = vae.decode(z).sample
        assert set(log.paths()) == {"upsample_nearest"} and set(log.paths()["upsample_nearest"]) == {"repeat"}
        assert torch.equal(fused, reference)
        assert unfuse_kernels(vae) == report.num_fused
        assert report.skipped == {} or all("disabled" in r for r in report.skipped.values())


def test_disabled_upsample_is_skipped_with_its_reason():
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           attn_scales=[]).eval()
    report = fuse_kernels(vae, FuseKernelsConfig(upsample=False))
    ups = [n for n, m in vae.named_modules() if type(m).__name__ == "WanUpsample"]
    assert ups and all(report.skipped[n] == "upsample disabled in FuseKernelsConfig" for n in ups)
