"""The rotary-table memo on diffusers' WanRotaryPosEmbed: the same tables as diffusers builds, built once per token
grid, built anew for another grid or after the buffers change, and removed by unfuse_kernels."""

from __future__ import annotations

import torch

from metainfer_gen.video.fuse import FuseKernelsConfig, fuse_kernels, unfuse_kernels
from metainfer_gen.video.fuse.wan_rope import MAX_GRIDS

ONLY_ROPE_TABLE = FuseKernelsConfig(adaln=False, qk_norm=False, rope=False, timestep_embedding=False)


def _rope():
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    return WanRotaryPosEmbed(attention_head_dim=24, patch_size=(1, 2, 2), max_seq_len=64)


def test_tables_equal_diffusers_and_are_built_once_per_grid():
    rope, latents = _rope(), torch.randn(1, 4, 3, 8, 8)
    expected = rope(latents)
    original = rope.forward
    report = fuse_kernels(rope, ONLY_ROPE_TABLE)
    assert report.fused == [""]  # the module itself
    first = rope(latents)
    for got, want in zip(first, expected):
        assert torch.equal(got, want)
    again = rope(torch.randn(2, 4, 3, 8, 8))  # another batch and content, same grid: the same tables
    assert again[0] is first[0] and again[1] is first[1]
    other = rope(torch.randn(1, 4, 5, 8, 12))
    assert other[0].shape == (1, 5 * 4 * 6, 1, 24)
    unfuse_kernels(rope)
    assert rope.forward == original
    for got, want in zip(other, rope(torch.randn(1, 4, 5, 8, 12))):
        assert torch.equal(got, want)


def test_changed_buffers_rebuild_the_tables_and_old_grids_are_dropped():
    rope, latents = _rope(), torch.randn(1, 4, 3, 8, 8)
    fuse_kernels(rope, ONLY_ROPE_TABLE)
    before = rope(latents)
    rope.freqs_cos.mul_(0.5)  # an in-place edit bumps the version counter
    after = rope(latents)
    assert after[0] is not before[0]
    torch.testing.assert_close(after[0], before[0] * 0.5)
    rope.to(torch.float64)  # new buffers: new tables in their dtype
    assert rope(latents)[0].dtype == torch.float64
    hook = rope._diffusers_hook.get_hook("metainfer_fused_kernels")
    for frames in range(1, MAX_GRIDS + 3):
        rope(torch.randn(1, 4, frames, 8, 8))
    assert len(hook.tables) == MAX_GRIDS


def test_config_can_leave_the_tables_alone():
    rope = _rope()
    report = fuse_kernels(rope, FuseKernelsConfig(rope_table=False))
    assert report.skipped == {"": "rope_table disabled in FuseKernelsConfig"}
