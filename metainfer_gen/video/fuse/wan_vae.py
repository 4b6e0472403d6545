"""Fusers for the Wan VAE: causal 3-D convolutions through ``conv3d``, channel RMS norms through ``channel_rms_norm``.

``WanCausalConv3d.forward`` (diffusers ``autoencoder_kl_wan.py``) prepends the cached last frames of the previous
chunk (or zeros) in time, pads height and width, and calls ``nn.Conv3d`` with zero padding. The hook below does the
same time padding, hands the height and width padding to the convolution itself (the same zeros, one copy of the
feature map fewer), and calls :func:`metainfer_gen.kernels.conv.conv3d`, which on the CPU runs oneDNN where
PyTorch's size rule would pick ``slow_conv3d`` (see that module). ``WanRMS_norm`` with ``channel_first=True``
goes through :func:`metainfer_gen.kernels.channel_norm.channel_rms_norm` (a sum of squares instead of
``F.normalize``'s strided ``linalg.vector_norm``). Weights and modules are untouched; ``unfuse_kernels`` restores
the original forwards. ``WanUpsample`` (an ``nn.Upsample`` whose forward goes through float32) goes through
:func:`metainfer_gen.kernels.upsample.upsample_nearest` in the feature map's own dtype (bit-identical).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from metainfer_gen.kernels.channel_norm import channel_rms_norm
from metainfer_gen.kernels.conv import conv3d
from metainfer_gen.kernels.upsample import NEAREST_MODES, upsample_nearest
from metainfer_gen.video.fuse.core import FuseKernelsConfig
from metainfer_gen.video.fuse.wan import _model_hook_base, _register

__all__ = ["FusedWanCausalConv3dHook", "FusedWanRMSNormHook", "FusedWanUpsampleHook", "fuse_wan_causal_conv3d",
           "fuse_wan_rms_norm", "fuse_wan_upsample"]


class FusedWanCausalConv3dHook(_model_hook_base()):
    """Replaces ``WanCausalConv3d.forward(x, cache_x=None)``: causal padding as diffusers, then ``conv3d``
    (audited at the call site ``"WanCausalConv3d"``)."""

    def new_forward(self, conv, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        width, _, height, _, front, back = conv._padding  # F.pad order: (W, W, H, H, T front, T back)
        if cache_x is not None and front > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            front -= cache_x.shape[2]
        if front > 0 or back > 0:
            x = F.pad(x, (0, 0, 0, 0, front, back))
        return conv3d(x, conv.weight, conv.bias, conv.stride, (0, height, width), conv.dilation, conv.groups,
                      site="WanCausalConv3d", strict=self.config.strict)


def fuse_wan_causal_conv3d(conv, name: str, config: FuseKernelsConfig) -> str | None:
    """Install :class:`FusedWanCausalConv3dHook` on a ``WanCausalConv3d``, or return why not."""
    if not config.conv3d:
        return "conv3d disabled in FuseKernelsConfig"
    params = list(inspect.signature(type(conv).forward).parameters)[1:]
    if params != ["x", "cache_x"]:
        return f"forward takes {params}, expected ['x', 'cache_x'] (diffusers version changed the layer)"
    padding = getattr(conv, "_padding", None)
    if padding is None or len(padding) != 6 or tuple(conv.padding) != (0, 0, 0) or conv.padding_mode != "zeros":
        return "no causal (_padding, zero conv padding) layout; the fused forward assumes diffusers' WanCausalConv3d"
    if padding[0] != padding[1] or padding[2] != padding[3] or min(padding) < 0:
        return f"asymmetric or negative spatial padding {tuple(padding)}: the convolution pads both sides alike"
    _register(conv, FusedWanCausalConv3dHook(config))
    return None


class FusedWanRMSNormHook(_model_hook_base()):
    """Replaces ``WanRMS_norm.forward(x)`` for ``channel_first=True``: ``channel_rms_norm`` (audited at the call
    site ``"WanRMS_norm"``)."""

    def new_forward(self, norm, x: torch.Tensor) -> torch.Tensor:
        return channel_rms_norm(x, norm.gamma, norm.bias, site="WanRMS_norm", strict=self.config.strict)


def fuse_wan_rms_norm(norm, name: str, config: FuseKernelsConfig) -> str | None:
    """Install :class:`FusedWanRMSNormHook` on a channels-first ``WanRMS_norm``, or return why not."""
    if not config.channel_norm:
        return "channel_norm disabled in FuseKernelsConfig"
    if not getattr(norm, "channel_first", False):
        return "channel_first=False normalises the last dimension (no strided reduction to avoid)"
    gamma, scale = getattr(norm, "gamma", None), getattr(norm, "scale", None)
    if not isinstance(gamma, torch.Tensor) or scale is None or abs(scale - gamma.shape[0] ** 0.5) > 1e-6:
        return "no (gamma, scale = sqrt(dim)) layout; the fused forward assumes diffusers' WanRMS_norm"
    _register(norm, FusedWanRMSNormHook(config))
    return None


class FusedWanUpsampleHook(_model_hook_base()):
    """Replaces ``WanUpsample.forward(x)`` (x (N, C, H, W)): ``upsample_nearest`` in x's dtype (audited at the call
    site ``"WanUpsample"``)."""

    def new_forward(self, up, x: torch.Tensor) -> torch.Tensor:
        return upsample_nearest(x, _integer_factors(up.scale_factor), up.mode, site="WanUpsample",
                                strict=self.config.strict)


def _integer_factors(scale_factor) -> tuple[int, int] | None:
    factors = tuple(scale_factor) if isinstance(scale_factor, (tuple, list)) else (scale_factor, scale_factor)
    if len(factors) != 2 or any(not isinstance(f, (int, float)) or f < 1 or int(f) != f for f in factors):
        return None
    return int(factors[0]), int(factors[1])


def fuse_wan_upsample(up, name: str, config: FuseKernelsConfig) -> str | None:
    """Install :class:`FusedWanUpsampleHook` on a ``WanUpsample``, or return why not."""
    if not config.upsample:
        return "upsample disabled in FuseKernelsConfig"
    params = list(inspect.signature(type(up).forward).parameters)[1:]
    if params != ["x"]:
        return f"forward takes {params}, expected ['x'] (diffusers version changed the layer)"
    if getattr(up, "mode", None) not in NEAREST_MODES or getattr(up, "size", None) is not None:
        return f"mode {getattr(up, 'mode', None)!r} with size {getattr(up, 'size', None)!r}: only nearest by factors"
    if _integer_factors(getattr(up, "scale_factor", None)) is None:
        return f"scale_factor {getattr(up, 'scale_factor', None)!r} is not two integer factors"
    _register(up, FusedWanUpsampleHook(config))
    return None
