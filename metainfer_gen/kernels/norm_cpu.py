"""The CPU's RMSNorm and residual-add + RMSNorm in C++ (``csrc/rms_norm.cpp``) for rows of any count.

One pass per row: the float32 sum of squares in vector registers, the row scaled and rounded once to its dtype;
the fused form stores ``x + residual`` rounded to x's dtype and normalises that (the arithmetic of
:func:`metainfer_gen.kernels.norm.rms_norm_reference`). Eager torch spends eight passes and two casts on a bf16 row;
``torch.compile`` has one graph per shape, so a prefill chunk of a new length ran the eager reference. Rows are split
over torch's threads. Registered after the compiled path, which stays ahead where it applies (2^20 elements and up,
a warmed-up shape): at (512, 4096) float32 it ran in 0.33 ms against this kernel's 0.58 on 2 Zen 4 cores; below
that size this kernel was 1.2-3.4x it (bf16 (2048, 384): 0.14 ms against 0.16; (64, 384): 0.012 against 0.034).
Built once per machine by :mod:`metainfer_gen.kernels.cpu_build`; where the build is off or fails the registry
refuses it with the reason.
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.common import dtype_refusal, first_refusal
from metainfer_gen.kernels.cpu_build import ensure_built, load_built

__all__ = ["KERNEL", "fused_add_rms_norm_cpp", "fused_add_rms_norm_cpp_supports", "rms_norm_cpp",
           "rms_norm_cpp_supports", "warm_up"]

KERNEL = "rms_norm"
_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm_cpp_supports(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                          residual: torch.Tensor | None = None) -> str | None:
    """None when the C++ kernel applies (CPU, float32 or bf16, weight and residual in x's dtype and contiguous, x
    contiguous or a matrix of rows with unit column stride (a column slice such as MLA's ``c_kv``), no autograd,
    the kernel built), else why not."""
    if x.device.type != "cpu":
        return f"x on {x.device}; the C++ kernel takes CPU tensors"
    others = [t for t in (weight, residual) if t is not None]
    mismatched = [f"{name} dtype {t.dtype} differs from x's {x.dtype}"
                  for name, t in (("weight", weight), ("residual", residual)) if t is not None and t.dtype != x.dtype]
    return first_refusal(
        dtype_refusal("x", x, _DTYPES),
        *mismatched,
        None if all(t.is_contiguous() for t in others) and (x.is_contiguous() or (x.ndim == 2 and x.stride(1) == 1))
        else "x (beyond a row stride), weight or residual is not contiguous",
        None if not (torch.is_grad_enabled() and any(t.requires_grad for t in [x, *others])) else
        "a tensor requires grad; the kernel has no backward",
    ) or load_built(KERNEL)[1]


def fused_add_rms_norm_cpp_supports(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                                    eps: float) -> str | None:
    """:func:`rms_norm_cpp_supports` with the residual checked too."""
    return rms_norm_cpp_supports(x, weight, eps, residual)


def rms_norm_cpp(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(..., N) -> (..., N) in x.dtype; see :func:`metainfer_gen.kernels.rms_norm`."""
    x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    return ensure_built(KERNEL).rms_norm(x2, weight, eps).view(x.shape)


def fused_add_rms_norm_cpp(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N), (..., N) -> (normed, x + residual) in x.dtype; see :func:`metainfer_gen.kernels.fused_add_rms_norm`."""
    n = x.shape[-1]
    out, summed = ensure_built(KERNEL).fused_add_rms_norm(x.reshape(-1, n), residual.reshape(-1, n), weight, eps)
    return out.view(x.shape), summed.view(x.shape)


def warm_up() -> str | None:
    """Build (or load) the kernel now, before the first request: None when ready, else the reason it is not."""
    return load_built(KERNEL)[1]
