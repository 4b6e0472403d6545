"""Shared fixtures: tiny random-weight diffusers Wan pipelines saved to disk, built once per test session.

The pipelines are standard diffusers objects built from configs (no network, no downloads) with the word-level
tokenizer and UMT5 encoder of the embedded demo model, small enough that a 2-step, 9-frame, 32x32 call takes a
fraction of a second on one CPU thread. Weights are seeded, so every session builds the same models.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The LLM's default run dtype follows the CPU (bf16 on AMX/AVX512-BF16, fp32 elsewhere): the suite pins float32 for
# itself and every server it starts, so token checks against transformers do not depend on the machine that runs them.
# Tests of the automatic choice clear it (tests/test_platform_dtype.py).
os.environ["METAINFER_DEFAULT_DTYPE"] = "float32"
# A CPU engine compiles its decode step once per batch size (llm/compiled_decode.py), seconds per size: the suite runs
# eager engines and tests the compiled step where it says so (tests/llm/test_compiled_decode.py clears this).
os.environ["METAINFER_ENFORCE_EAGER"] = "1"

Z_DIM = 4  # latent channels of the tiny VAE


def _tiny_vae():
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=Z_DIM,
        dim_mult=[1, 2, 4],  # two spatial downsamples: 4x
        num_res_blocks=1,
        temperal_downsample=[True, True],  # 4x temporal: num_frames = 4k + 1
        latents_mean=[0.0] * Z_DIM,
        latents_std=[1.0] * Z_DIM,
        scale_factor_spatial=4,
        scale_factor_temporal=4,
    ).eval()


def _tiny_transformer(in_channels: int, text_dim: int, num_heads: int = 2):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(1)
    # rope_max_seq_len keeps diffusers' default (1024) so that size errors in the tests come from the grid rule,
    # not from the position table.
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=num_heads,
        attention_head_dim=8,
        in_channels=in_channels,
        out_channels=Z_DIM,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        image_dim=None,
    ).eval()


def _text_parts():
    from demo_models.video.components import build_text_encoder, build_tokenizer

    encoder = build_text_encoder(seed=2)
    return build_tokenizer(), encoder, encoder.config.d_model


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0)


@pytest.fixture
def interpret(monkeypatch):
    """Run Triton kernels in the interpreter on CPU tensors for the duration of one test."""
    pytest.importorskip("triton", reason="the Triton rows need triton (pip install 'metainfer-gen[kernels]')")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def no_interpret(monkeypatch):
    """A plain run: no Triton interpreter, whatever the caller's environment says."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)



def _save_t2v(path: Path, num_heads: int = 2) -> Path:
    """A ``diffusers.WanPipeline``, Wan 2.2 TI2V-style (``expand_timesteps=True``), saved to ``path``."""
    from diffusers import WanPipeline

    tokenizer, text_encoder, text_dim = _text_parts()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=_tiny_vae(),
                       transformer=_tiny_transformer(Z_DIM, text_dim, num_heads), scheduler=_scheduler(),
                       expand_timesteps=True)
    pipe.save_pretrained(str(path))
    return path


def _save_i2v(path: Path, num_heads: int = 2) -> Path:
    """A Wan 2.1-style ``diffusers.WanImageToVideoPipeline`` without a CLIP image encoder, saved to ``path``.

    The transformer reads the noisy latents concatenated with the 4-channel first-frame mask and the image
    latents (``in_channels = 2 * z_dim + 4``); this checkpoint cannot do text-to-video.
    """
    from diffusers import WanImageToVideoPipeline

    tokenizer, text_encoder, text_dim = _text_parts()
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=_tiny_vae(),
                                   transformer=_tiny_transformer(2 * Z_DIM + 4, text_dim, num_heads),
                                   scheduler=_scheduler(), image_encoder=None, image_processor=None,
                                   expand_timesteps=False)
    pipe.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory) -> Path:
    """A saved ``diffusers.WanPipeline``, Wan 2.2 TI2V-style (``expand_timesteps=True``): T2V and I2V weights."""
    return _save_t2v(tmp_path_factory.mktemp("tiny_wan"))


@pytest.fixture(scope="session")
def tiny_wan_i2v_dir(tmp_path_factory) -> Path:
    """A saved Wan 2.1-style image-to-video pipeline (see :func:`_save_i2v`)."""
    return _save_i2v(tmp_path_factory.mktemp("tiny_wan_i2v"))


@pytest.fixture(scope="session")
def tiny_wan_4_heads(tmp_path_factory) -> dict[str, Path]:
    """The two tiny pipelines with 4 attention heads, so Ulysses context parallelism splits them 2 and 4 ways:
    ``{"t2v": dir, "i2v": dir}``."""
    return {"t2v": _save_t2v(tmp_path_factory.mktemp("tiny_wan_4h"), num_heads=4),
            "i2v": _save_i2v(tmp_path_factory.mktemp("tiny_wan_i2v_4h"), num_heads=4)}


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """(transformers model, tokenizer, directory) of a tiny random DeepSeek-V3 with a BPE tokenizer."""
    from tests.llm.checkpoints import save_text_checkpoint

    path = tmp_path_factory.mktemp("deepseek_text")
    model, tokenizer = save_text_checkpoint(path)
    return model, tokenizer, path
