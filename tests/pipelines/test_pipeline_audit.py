"""Pipelines expose the kernel audit of their last call; fused kernels apply from outside and come off cleanly."""

import numpy as np
import pytest

from metainfer_gen import pipelines

CALL = dict(num_frames=5, height=32, width=32, num_inference_steps=2, guidance_scale=3.0, seed=0)


@pytest.fixture()
def pipe(tiny_wan_dir):
    p = pipelines.TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu")
    p.set_progress_bar_config(disable=True)
    return p


def test_last_audit_lists_the_fused_paths_and_outputs_match(pipe):
    reference = pipe("a red circle moving right", **CALL).frames
    assert pipe.last_audit is not None and pipe.last_audit.num_calls == 0  # unfused: no registry kernel ran
    pipe.enable_fused_kernels()
    fused = pipe("a red circle moving right", **CALL).frames
    ops = set(pipe.last_audit.paths())
    assert {"adaln_modulate", "gated_residual", "conv3d", "channel_rms_norm"} <= ops, ops  # the VAE's too
    assert np.abs(fused.astype(int) - reference.astype(int)).max() <= 2  # uint8 levels, fp32 reordering
    pipe.disable_fused_kernels()
    assert np.array_equal(pipe("a red circle moving right", **CALL).frames, reference)
    assert pipe.last_audit.num_calls == 0


def test_vae_kernels_alone_and_from_pipe_sharing_them(pipe):
    reference = pipe("a red circle moving right", **CALL).frames
    pipe.enable_fused_kernels(transformer=False)
    fused = pipe("a red circle moving right", **CALL).frames
    assert set(pipe.last_audit.paths()) == {"conv3d", "channel_rms_norm", "upsample_nearest"}
    assert np.abs(fused.astype(int) - reference.astype(int)).max() <= 1
    i2v = pipelines.ImageToVideoPipeline.from_pipe(pipe)
    i2v.enable_fused_kernels()  # the shared VAE is already fused: left as it is, the transformer is fused now
    pipe.disable_fused_kernels()
    assert np.array_equal(pipe("a red circle moving right", **CALL).frames, reference)


def test_a_config_picks_the_ops_outside_the_blocks(pipe):
    from metainfer_gen.video.fuse import FuseKernelsConfig

    reference = pipe("a red circle moving right", **CALL).frames
    pipe.enable_fused_kernels(config=FuseKernelsConfig(adaln=False, qk_norm=False, rope=False))
    fused = pipe("a red circle moving right", **CALL).frames
    assert set(pipe.last_audit.paths()) == {"conv3d", "channel_rms_norm", "upsample_nearest",
                                           "timestep_embedding"}
    assert np.abs(fused.astype(int) - reference.astype(int)).max() <= 1
    pipe.disable_fused_kernels()
    assert np.array_equal(pipe("a red circle moving right", **CALL).frames, reference)


def test_cli_audit_flag_prints_the_summary(tiny_wan_dir, tmp_path, capsys):
    from metainfer_gen.apps.cli import main

    code = main(["render", "a red circle moving right", "-o", str(tmp_path / "c.mp4"), "--model", str(tiny_wan_dir),
                 "--steps", "2", "--num-frames", "5", "--height", "32", "--width", "32", "--fused-kernels", "--audit"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "adaln_modulate" in printed and "gated_residual" in printed


def test_fused_kernels_and_the_step_cache_compose_in_either_order(pipe):
    """The README enables the step cache, then the kernels: fusing lifts the cache's block hooks and puts them
    back, so both orders give the same clip, the cache still reuses, and turning both off restores the original."""
    call = dict(CALL, num_inference_steps=12)
    reference = pipe("a red circle moving right", **call).frames
    clips = []
    for cache_first in (True, False):
        if cache_first:
            pipe.enable_step_cache("fast")
        pipe.enable_fused_kernels()
        if not cache_first:
            pipe.enable_step_cache("fast")
        out = pipe("a red circle moving right", **call)
        assert "adaln_modulate" in set(pipe.last_audit.paths())
        assert out.stats.block_evaluations < 2 * 12 * len(pipe.diffusers_pipeline.transformer.blocks)  # reused
        clips.append(out.frames)
        pipe.disable_fused_kernels()  # lifts and restores the cache again
        assert pipe.step_cache is not None
        pipe.disable_step_cache()
        assert np.array_equal(pipe("a red circle moving right", **call).frames, reference)
    assert np.array_equal(clips[0], clips[1])
