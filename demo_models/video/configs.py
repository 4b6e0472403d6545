"""Architecture of the embedded demo model: one place for every component's config.

The model is a standard diffusers Wan pipeline (so stock ``diffusers.WanPipeline.from_pretrained`` loads it), only
small: a causal 3D VAE with 4x spatial and 4x temporal compression (Wan 2.2's residual variant: 48 latent channels,
space-to-channel shortcuts around every down/up block), a 6-layer Wan DiT, and a frozen random tiny
UMT5 text encoder over a word-level tokenizer. The transformer is trained Wan 2.2 TI2V-style (per-token timesteps,
a clean first latent frame half of the time), so the same weights serve text-to-video and image-to-video.
"""

from __future__ import annotations

NUM_FRAMES = 17
SIZE = 64
# Prompt-embedding rows the transformer reads (``max_sequence_length``): a prompt's words, ``</s>``, then zero rows.
# Wan's cross-attention has no mask, so every zero row takes a share of the softmax; 16 instead of diffusers' 512
# doubled the held-out direction accuracy (docs/demo_model.md).
TEXT_MAX_LENGTH = 16
Z_DIM = 48

VAE_CONFIG = dict(
    base_dim=32,
    decoder_base_dim=32,
    z_dim=Z_DIM,
    dim_mult=[1, 2, 2],  # the residual blocks need equal widths where nothing is resampled
    is_residual=True,  # Wan 2.2: AvgDown3D / DupUp3D shortcuts; 3x faster start than plain (19.3 vs 15.4 dB, step 100)
    num_res_blocks=1,
    temperal_downsample=[True, True],
    latents_mean=[0.0] * Z_DIM,  # replaced by measured statistics after training
    latents_std=[1.0] * Z_DIM,
    scale_factor_spatial=4,
    scale_factor_temporal=4,
)

TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=32,
    in_channels=Z_DIM,
    out_channels=Z_DIM,
    text_dim=64,
    freq_dim=128,
    ffn_dim=512,
    num_layers=6,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)

TEXT_ENCODER_CONFIG = dict(
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_decoder_layers=0,
    num_heads=4,
    relative_attention_num_buckets=8,
    dropout_rate=0.0,
    feed_forward_proj="gated-gelu",
)

SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0)
