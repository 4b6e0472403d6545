"""Wan VAE decode in chunks of several latent frames instead of one: the same clip, fewer and larger convolutions.

diffusers' ``AutoencoderKLWan._decode`` runs its causal decoder once per latent frame, carrying the last two input
frames of every causal convolution (``feat_cache``) from one call to the next. Every convolution is causal in
time, so a call on several latent frames with the same cache computes the same frames: the decoder's own cache
logic already handles chunks of any length after the first (``cache_x = x[:, :, -2:]``; the temporal upsampler's
"Rep" state treats the first chunk, a single frame, specially, and ``DupUp3D`` trims only the first chunk). So
the first latent frame is decoded alone (``first_chunk=True``, as diffusers does) and the rest in chunks of up to
:func:`chunk_frames` frames; on the embedded model (17 frames 64x64, 5 latent frames) that is 2 decoder calls
instead of 5, the same clip within float32 rounding (max abs difference 1.2e-6 in [-1, 1]).

Activation memory grows with the chunk, which is why diffusers decodes frame by frame: the chunk is bounded so its
largest feature map stays under :data:`DECODE_CHUNK_BYTES` (an upper bound from the VAE config: temporal and
spatial upsampling times the widest decoder convolution), so a large clip decodes one frame at a time, exactly as
diffusers does. Tiled decoding (``enable_tiling``) and everything else stay diffusers' own.

Installed by :func:`fuse_wan_vae_decode` as a fuse hook on ``AutoencoderKLWan`` that points the instance's
``_decode`` at :func:`decode_in_chunks`; removing the hook (``unfuse_kernels``) restores diffusers' method.
Source: diffusers 0.42 ``autoencoder_kl_wan.py`` (``_decode``, ``WanCausalConv3d``, ``WanResample``, ``DupUp3D``).
"""

from __future__ import annotations

import inspect
import types

import torch

from metainfer_gen.video.fuse.core import FuseKernelsConfig
from metainfer_gen.video.fuse.wan import _model_hook_base, _register

__all__ = ["DECODE_CHUNK_BYTES", "FusedWanDecodeHook", "chunk_frames", "decode_in_chunks", "frame_bytes",
           "fuse_wan_vae_decode"]

DECODE_CHUNK_BYTES = 256 * 2**20  # bound on a chunk's largest decoder feature map


def frame_bytes(vae, latent_shape: tuple[int, ...], element_size: int) -> int:
    """An upper bound on the bytes of the decoder's largest feature map per latent frame.

    Args:
        vae: an ``AutoencoderKLWan``. latent_shape: (N, C, T, H, W) of the latents. element_size: bytes per value.
    The bound: N x ``scale_factor_temporal`` frames x the decoder's output height and width (latent size x
    ``scale_factor_spatial`` / ``patch_size``) x the widest decoder convolution's channels.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    batch, _, _, height, width = latent_shape
    config = vae.config
    spatial = config.scale_factor_spatial // (config.patch_size or 1)
    channels = max((m.out_channels for m in vae.decoder.modules() if isinstance(m, WanCausalConv3d)), default=1)
    return batch * config.scale_factor_temporal * height * spatial * width * spatial * channels * element_size


def chunk_frames(vae, latent_shape: tuple[int, ...], element_size: int,
                 budget_bytes: int = DECODE_CHUNK_BYTES) -> int:
    """Latent frames per decoder call (at least 1) whose largest feature map stays under ``budget_bytes``
    (:func:`frame_bytes` per frame)."""
    return max(1, budget_bytes // max(1, frame_bytes(vae, latent_shape, element_size)))


def decode_in_chunks(vae, z: torch.Tensor, return_dict: bool = True, *,
                     budget_bytes: int = DECODE_CHUNK_BYTES):
    """``AutoencoderKLWan._decode`` with the frames after the first decoded several at a time.

    Args:
        vae: the ``AutoencoderKLWan``. z: (N, z_dim, T, H, W) latents in the VAE's dtype.
        return_dict: as diffusers (a ``DecoderOutput`` or a 1-tuple).
        budget_bytes: see :func:`chunk_frames`.
    Returns:
        the decoded clip (N, 3, frames, height, width) clamped to [-1, 1], as diffusers' ``_decode``.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify
    from diffusers.models.autoencoders.vae import DecoderOutput

    _, _, num_frames, height, width = z.shape
    ratio = vae.spatial_compression_ratio
    if vae.use_tiling and (width > vae.tile_sample_min_width // ratio or height > vae.tile_sample_min_height // ratio):
        return vae.tiled_decode(z, return_dict=return_dict)
    step = chunk_frames(vae, tuple(z.shape), z.element_size(), budget_bytes)
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    bounds = [(0, 1)] + [(lo, min(num_frames, lo + step)) for lo in range(1, num_frames, step)]
    outs = []
    for index, (lo, hi) in enumerate(bounds):
        vae._conv_idx = [0]
        outs.append(vae.decoder(x[:, :, lo:hi], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                first_chunk=index == 0))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    out = torch.clamp(out, min=-1.0, max=1.0)
    vae.clear_cache()
    return DecoderOutput(sample=out) if return_dict else (out,)


class FusedWanDecodeHook(_model_hook_base()):
    """Points ``AutoencoderKLWan._decode`` at :func:`decode_in_chunks` while installed (the forward is untouched:
    diffusers' ``decode`` calls ``self._decode``)."""

    def initialize_hook(self, module):
        module._decode = types.MethodType(decode_in_chunks, module)
        return module

    def deinitalize_hook(self, module):  # diffusers' spelling
        module.__dict__.pop("_decode", None)
        return module


def fuse_wan_vae_decode(vae, name: str, config: FuseKernelsConfig) -> str | None:
    """Install :class:`FusedWanDecodeHook` on an ``AutoencoderKLWan``, or return why not."""
    if not config.vae_decode_chunks:
        return "vae_decode_chunks disabled in FuseKernelsConfig"
    decode = getattr(type(vae), "_decode", None)
    if decode is None or list(inspect.signature(decode).parameters)[1:] != ["z", "return_dict"]:
        return "no _decode(z, return_dict) (diffusers version changed the VAE)"
    needed = ("decoder", "post_quant_conv", "clear_cache", "tiled_decode")
    missing = [attr for attr in needed if not hasattr(vae, attr)]
    if missing or not hasattr(vae.config, "scale_factor_temporal"):
        return f"no {missing or ['config.scale_factor_temporal']}: the chunked decode assumes diffusers' Wan VAE"
    if "_decode" in vae.__dict__:
        return "_decode is already replaced on this instance"
    _register(vae, FusedWanDecodeHook(config))
    return None
