"""3-D convolution through oneDNN on the CPU, where PyTorch's own rule silently picks its slow generic path.

PyTorch (``aten/src/ATen/native/Convolution.cpp``, ``ConvParams::use_mkldnn``, unchanged through 2.13) sends a
float32 CPU convolution with a kernel of at most 3x3 and batch 1 to oneDNN only when ``N * C * D * H`` (the first
four sizes) exceeds 20480. The rule was written for 2-D inputs, where those four are ``N * C * H * W``; on a 5-D
input the fourth size is the height, so small-batch video convolutions run ``slow_conv3d`` (im2col then GEMM)
instead. A causal video VAE decoding one latent frame at a time is exactly that case: Wan's ``WanCausalConv3d``
on the embedded model's decoder (batch 1, 3x3x3 kernels, 32-64 channels, 3-6 frames of 18-66 px) spends 75% of its
decode in ``slow_conv3d``; ``torch.mkldnn_convolution`` computes the same convolution 2.2x faster (one core;
``benchmarks/kernel_table.py --ops conv3d``) and the whole decode 2.3x (one thread) to 2.7x (two) faster, equal to
float32 rounding (max abs difference 3.6e-6 on the decoded clip in [-1, 1]).

Implementations, fastest first: ``onednn`` (``torch.mkldnn_convolution``; CPU float32, and bfloat16 / float16
where this CPU has oneDNN's kernels for them, which is the call PyTorch itself makes for those dtypes: bit-equal to
``F.conv3d`` in bf16 on an AVX512-BF16 CPU; oneDNN built in and enabled, no autograd) and ``torch``
(``torch.nn.functional.conv3d``, the reference; on CUDA cuDNN already serves it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metainfer_gen.kernels.common import first_refusal
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["conv3d", "conv3d_onednn", "conv3d_reference", "onednn_supports_dtype"]

Triple = tuple[int, int, int]


def conv3d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Triple,
                     padding: Triple, dilation: Triple, groups: int) -> torch.Tensor:
    """``torch.nn.functional.conv3d``: x (N, C_in, D, H, W), weight (C_out, C_in / groups, kD, kH, kW)."""
    return F.conv3d(x, weight, bias, stride, padding, dilation, groups)


def conv3d_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Triple,
                  padding: Triple, dilation: Triple, groups: int) -> torch.Tensor:
    """The same convolution through oneDNN (``torch.mkldnn_convolution``), whatever PyTorch's size rule says."""
    return torch.mkldnn_convolution(x.contiguous(), weight.contiguous(), bias, list(padding), list(stride),
                                    list(dilation), groups)


def onednn_supports_dtype(dtype: torch.dtype) -> bool:
    """Whether this CPU runs oneDNN's convolution in ``dtype`` (PyTorch's own checks for bf16 and fp16)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def _onednn_supports(x, weight, bias, stride, padding, dilation, groups) -> str | None:
    def device_refusal():
        if x.device.type != "cpu" or weight.device.type != "cpu":
            return f"input on {x.device.type}: oneDNN is the CPU library (cuDNN already serves GPU convolutions)"
        return None

    def dtype_refusal():
        if x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {x.dtype}/{weight.dtype}: oneDNN convolves float32, bfloat16 or float16, one dtype"
        if not onednn_supports_dtype(x.dtype):
            need = "avx512bw (AVX512-BF16, AMX)" if x.dtype == torch.bfloat16 else "avx_ne_convert or avx512_fp16"
            return f"{x.dtype} on a CPU without {need}: oneDNN has no such kernel here (PyTorch's slow path runs)"
        return None

    def library_refusal():
        if not torch.backends.mkldnn.is_available():
            return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
        if not torch.backends.mkldnn.enabled:
            return "oneDNN disabled (torch.backends.mkldnn.enabled = False)"
        return None

    def autograd_refusal():
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            return "autograd: training keeps torch's conv3d (this path serves inference)"
        return None

    return first_refusal(device_refusal(), dtype_refusal(), library_refusal(), autograd_refusal())


def _example(device: str, dtype: torch.dtype):
    # One latent frame of the embedded Wan VAE's decoder: causal time padding already applied.
    x = torch.randn(1, 64, 6, 34, 34, device=device, dtype=dtype)
    weight = torch.randn(64, 64, 3, 3, 3, device=device, dtype=dtype) * 0.02
    return (x, weight, torch.zeros(64, device=device, dtype=dtype), (1, 1, 1), (0, 0, 0), (1, 1, 1), 1), {}


CONV3D = register_op(Op("conv3d", "3-D convolution (video VAE causal convs)", _example))
CONV3D.register("onednn", conv3d_onednn, _onednn_supports, devices=("cpu",),
                description="torch.mkldnn_convolution: float32, where PyTorch's 2-D size rule picks slow_conv3d, "
                            "and bf16 / fp16 where this CPU has oneDNN's kernels")
CONV3D.register("torch", conv3d_reference, description="torch.nn.functional.conv3d")


def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: Triple = (1, 1, 1),
           padding: Triple = (0, 0, 0), dilation: Triple = (1, 1, 1), groups: int = 1, *, site: str | None = None,
           strict: bool | None = None) -> torch.Tensor:
    """3-D convolution, as ``torch.nn.functional.conv3d`` with explicit triples.

    Args:
        x: (N, C_in, D, H, W) float tensor.
        weight: (C_out, C_in / groups, kD, kH, kW); bias: (C_out,) or None.
        stride, padding, dilation: (depth, height, width) triples of ints (zero padding).
        groups: channel groups.
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        (N, C_out, D', H', W') in ``x.dtype``.
    Raises:
        ValueError: x not 5-D, weight not 5-D, or a triple of the wrong length.
    Tolerance against :func:`conv3d_reference`: float32 rounding (rtol=1e-5, atol=1e-5 on unit-scale inputs).
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 5:
        raise ValueError(f"x must be (N, C, D, H, W); got shape {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or weight.ndim != 5:
        raise ValueError(f"weight must be (C_out, C_in / groups, kD, kH, kW); got "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    triples = {"stride": stride, "padding": padding, "dilation": dilation}
    for name, value in triples.items():
        if len(tuple(value)) != 3:
            raise ValueError(f"{name} must be a (depth, height, width) triple; got {value!r}")
    stride, padding, dilation = (tuple(int(v) for v in value) for value in triples.values())
    return CONV3D.dispatch(x, weight, bias, stride, padding, dilation, int(groups), site=site, strict=strict,
                           stacklevel=2)
