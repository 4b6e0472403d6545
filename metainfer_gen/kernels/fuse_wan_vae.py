"""Fuser for the Wan VAE: its causal 3-D convolutions through the registry's ``conv3d`` op.

``WanCausalConv3d.forward`` (diffusers ``autoencoder_kl_wan.py``) prepends the cached last frames of the previous
chunk (or zeros) in time, pads height and width, and calls ``nn.Conv3d`` with zero padding. The hook below does the
same padding, verbatim, and then calls :func:`metainfer_gen.kernels.conv.conv3d`, which on the CPU runs oneDNN
where PyTorch's size rule would pick ``slow_conv3d`` (see that module). Weights and the module are untouched;
``unfuse_kernels`` restores the original forward.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from metainfer_gen.kernels.conv import conv3d
from metainfer_gen.kernels.fuse import FuseKernelsConfig
from metainfer_gen.kernels.fuse_wan import _model_hook_base, _register

__all__ = ["FusedWanCausalConv3dHook", "fuse_wan_causal_conv3d"]


class FusedWanCausalConv3dHook(_model_hook_base()):
    """Replaces ``WanCausalConv3d.forward(x, cache_x=None)``: causal padding as diffusers, then ``conv3d``
    (audited at the call site ``"WanCausalConv3d"``)."""

    _is_stateful = False

    def __init__(self, config: FuseKernelsConfig):
        super().__init__()
        self.config = config

    def new_forward(self, conv, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        padding = list(conv._padding)
        if cache_x is not None and conv._padding[4] > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            padding[4] -= cache_x.shape[2]
        x = F.pad(x, padding)
        return conv3d(x, conv.weight, conv.bias, conv.stride, (0, 0, 0), conv.dilation, conv.groups,
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
    _register(conv, FusedWanCausalConv3dHook(config))
    return None
