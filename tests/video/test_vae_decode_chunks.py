"""The Wan VAE decoded several latent frames a call: the stock per-frame clip, bounded chunks, a clean unfuse."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.video.fuse import FuseKernelsConfig, fuse_kernels, unfuse_kernels
from metainfer_gen.video.fuse.wan_vae_decode import chunk_frames, decode_in_chunks, frame_bytes

# Wan 2.1's layout (no residual up blocks) and Wan 2.2's (residual DupUp3D shortcuts, 2x2 patches), tiny.
VAES = {
    "wan2.1": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                   attn_scales=[]),
    "wan2.2": dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                   temperal_downsample=[True, True], attn_scales=[], is_residual=True, patch_size=2, in_channels=12,
                   out_channels=12, scale_factor_spatial=8),
}


def _vae(kind: str):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(**VAES[kind]).eval()


@pytest.mark.parametrize("kind", sorted(VAES))
@pytest.mark.parametrize("latent_frames", [1, 2, 5])
def test_chunks_decode_the_stock_clip(kind, latent_frames):
    vae = _vae(kind)
    z = torch.randn(1, 4, latent_frames, 4, 4)
    with torch.no_grad():
        stock = vae.decode(z).sample
        assert stock.shape[2] == 1 + 4 * (latent_frames - 1)
        # budget 0: one frame a call, diffusers' own order of calls, so the same values bit for bit
        assert torch.equal(decode_in_chunks(vae, z, budget_bytes=0).sample, stock)
        for budget in (2 * frame_bytes(vae, tuple(z.shape), 4), 2**40):  # two latent frames a call, then all of them
            torch.testing.assert_close(decode_in_chunks(vae, z, budget_bytes=budget).sample, stock,
                                       rtol=1e-5, atol=1e-5)


def test_chunk_frames_grows_with_the_budget_and_shrinks_with_the_clip():
    vae = _vae("wan2.1")
    small, large = (1, 4, 9, 4, 4), (1, 4, 9, 16, 16)
    assert chunk_frames(vae, small, 4, 0) == 1  # never below one frame
    assert chunk_frames(vae, small, 4, 2**30) > chunk_frames(vae, small, 4, 2**20) >= 1
    assert chunk_frames(vae, large, 4, 2**24) < chunk_frames(vae, small, 4, 2**24)
    assert chunk_frames(vae, small, 2, 2**20) == 2 * chunk_frames(vae, small, 4, 2**20)  # bf16: twice the frames


def test_the_fuser_points_decode_at_the_chunks_and_unfuses_exactly():
    vae = _vae("wan2.2")
    z = torch.randn(1, 4, 3, 4, 4)
    with torch.no_grad():
        stock = vae.decode(z).sample
        report = fuse_kernels(vae, FuseKernelsConfig(conv3d=False, channel_norm=False, upsample=False))
        assert report.fused == [""] and "_decode" in vae.__dict__  # the VAE itself, nothing inside it
        torch.testing.assert_close(vae.decode(z).sample, stock, rtol=1e-5, atol=1e-5)
        assert unfuse_kernels(vae) == 1 and "_decode" not in vae.__dict__
        assert torch.equal(vae.decode(z).sample, stock)
    skipped = fuse_kernels(_vae("wan2.1"), FuseKernelsConfig(vae_decode_chunks=False)).skipped
    assert skipped[""] == "vae_decode_chunks disabled in FuseKernelsConfig"


def test_tiled_decoding_stays_diffusers_own():
    vae = _vae("wan2.1")
    vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=12,
                      tile_sample_stride_width=12)
    z = torch.randn(1, 4, 2, 8, 8)  # 32x32 px: larger than a tile
    with torch.no_grad():
        stock = vae.decode(z).sample
        fuse_kernels(vae, FuseKernelsConfig(conv3d=False, channel_norm=False, upsample=False))
        assert torch.equal(vae.decode(z).sample, stock)
