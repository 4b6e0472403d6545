"""RMSNorm and fused residual-add + RMSNorm: Triton kernel, C++ CPU kernel, torch.compile'd
CPU path, torch reference.

    rms_norm(x)                   = x / sqrt(mean(x**2, -1) + eps) * weight
    fused_add_rms_norm(x, r)      = (rms_norm(s), s)   with s = x + r rounded to x.dtype

Statistics are computed in float32 whatever the input dtype and the result is rounded once to ``x.dtype``. The
fused variant normalises the *rounded* sum, as Hugging Face decoder layers do (``residual = hidden + residual`` in
the model dtype, then the norm) and as vLLM's ``fused_add_rms_norm`` kernel does (it stores the sum, then reads it
back). Unlike vLLM it is functional: it returns new tensors instead of overwriting its inputs.

Sources: ``torch.nn.RMSNorm`` (``eps=None`` means ``torch.finfo(x.dtype).eps``), vLLM ``csrc/layernorm_kernels.cu``,
Triton tutorial ``05-layer-norm.py`` (one program per row, whole row in registers, num_warps from the block size).
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.common import (CompiledPath, _sum_combine, contiguous_refusal, dtype_refusal,
                                          first_refusal, lazy_triton_kernel, row_bytes_refusal, triton_refusal)
from metainfer_gen.kernels.launch import launch
from metainfer_gen.kernels.norm_cpu import (fused_add_rms_norm_cpp, fused_add_rms_norm_cpp_supports, rms_norm_cpp,
                                            rms_norm_cpp_supports)
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_reference", "rms_norm", "rms_norm_reference"]


# --- torch reference -------------------------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(..., N) -> (..., N) in x.dtype; float32 statistics."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N), (..., N) -> (normed, x + residual), both in x.dtype."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(summed, weight, eps), summed


# --- Triton kernel ---------------------------------------------------------------------------------------------

# Bound on the first kernel build (triton is imported lazily); kernels look names up in module globals.
add = tl = triton = None


@lazy_triton_kernel
def _kernel():
    global add, tl, triton  # kernels resolve names through module globals (closures are not seen)
    import triton
    import triton.language as tl

    add = _sum_combine(tl)

    @triton.jit
    def rms_norm_kernel(
        x_ptr,  # (M, N) input rows; row stride stride_x, unit column stride
        res_ptr,  # (M, N) residual rows, row stride stride_r (read only when HAS_RESIDUAL)
        w_ptr,  # (N,) weight (read only when HAS_WEIGHT)
        out_ptr,  # (M, N) contiguous output, x.dtype
        res_out_ptr,  # (M, N) contiguous x + residual rounded to x.dtype (written only when HAS_RESIDUAL)
        N,  # row length
        stride_x,
        stride_r,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        BLOCK_N: tl.constexpr,  # next power of two >= N: the whole row in one program
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            summed = (x + r).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * N + cols, summed, mask=mask)
            x = summed.to(tl.float32)  # normalise the rounded sum, as the unfused model does
        rstd = tl.rsqrt(tl.reduce(x * x, 0, add) / N + eps)
        y = x * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return rms_norm_kernel


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    block = 1 << max(n - 1, 0).bit_length()
    if x2.shape[0] > 0:
        launch(_kernel(), (x2.shape[0],),
            x2, r2, weight if weight is not None else x2, out, res_out, n, x2.stride(0), r2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, BLOCK_N=block,
            num_warps=min(max(block // 256, 1), 8),
        )
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)


def _triton_supports(x, weight, eps, residual=None) -> str | None:
    return first_refusal(
        triton_refusal(x, residual, weight),
        dtype_refusal("x", x),
        dtype_refusal("weight", weight) if weight is not None else None,
        contiguous_refusal("x", x),
        contiguous_refusal("residual", residual),
        contiguous_refusal("weight", weight),
        row_bytes_refusal("x", x.shape[-1], 4),  # the row is held in float32
    )


def _fused_triton_supports(x, residual, weight, eps) -> str | None:
    return _triton_supports(x, weight, eps, residual)


# --- registration and public API -------------------------------------------------------------------------------

def _example(device: str, dtype: torch.dtype):
    x = torch.randn(512, 4096, device=device, dtype=dtype)  # 2M elements: a prefill chunk of a 4096-wide LLM
    return (x, torch.ones(4096, device=device, dtype=dtype), 1e-6), {}


def _fused_example(device: str, dtype: torch.dtype):
    (x, w, eps), _ = _example(device, dtype)
    return (x, torch.randn_like(x), w, eps), {}


_compiled = CompiledPath(rms_norm_reference)
_fused_compiled = CompiledPath(fused_add_rms_norm_reference)

RMS_NORM = register_op(Op("rms_norm", "RMSNorm over the last dimension", _example))
RMS_NORM.register("triton", rms_norm_triton, _triton_supports, description="one program per row")
RMS_NORM.register("compiled", _compiled, _compiled.refusal, description="torch.compile(reference), static shapes")
RMS_NORM.register("cpp", rms_norm_cpp, rms_norm_cpp_supports, devices=("cpu",),
                  description="C++ one pass per row, any row count (float32, bf16)")
RMS_NORM.register("torch", rms_norm_reference, description="eager reference, float32 statistics")

FUSED_ADD_RMS_NORM = register_op(Op("fused_add_rms_norm", "residual add then RMSNorm, one pass", _fused_example))
FUSED_ADD_RMS_NORM.register("triton", fused_add_rms_norm_triton, _fused_triton_supports,
                            description="one program per row, writes sum and norm")
FUSED_ADD_RMS_NORM.register("compiled", _fused_compiled, _fused_compiled.refusal,
                            description="torch.compile(reference), static shapes")
FUSED_ADD_RMS_NORM.register("cpp", fused_add_rms_norm_cpp, fused_add_rms_norm_cpp_supports, devices=("cpu",),
                            description="C++ one pass per row, writes sum and norm (float32, bf16)")
FUSED_ADD_RMS_NORM.register("torch", fused_add_rms_norm_reference, description="eager reference")


def _check(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> float:
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        raise TypeError(f"x must be a tensor with at least 1 dimension; got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor; got {x.dtype}")
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} must be ({x.shape[-1]},), the last dim of x")
    eps = torch.finfo(x.dtype).eps if eps is None else float(eps)
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    return eps


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None, *,
             site: str | None = None, strict: bool | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension, by the fastest implementation that applies.

    Args:
        x: (..., N) float32/bfloat16/float16 (any float dtype on the torch paths).
        weight: (N,) scale, any float dtype, or None.
        eps: added to the mean square; None -> ``torch.finfo(x.dtype).eps`` as ``torch.nn.RMSNorm``.
        site: audit call-site name (default: the caller's file and line); strict: see the registry.
    Returns:
        (..., N) in ``x.dtype``.
    Raises:
        TypeError: x not a floating tensor. ValueError: weight shape or eps wrong.
        FastPathRefused: strict mode and a faster path was refused.
    Tolerance against :func:`rms_norm_reference`: exact order of operations differs (tree reductions), so
    atol=rtol=1e-5 in float32 and one bf16 ulp (atol=rtol=1.6e-2) in bfloat16.
    """
    eps = _check(x, weight, eps)
    return RMS_NORM.dispatch(x, weight, eps, site=site, strict=strict, stacklevel=2)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                       eps: float | None = None, *, site: str | None = None,
                       strict: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to x.dtype) and ``rms_norm(s)``, in one pass over memory.

    Args:
        x, residual: (..., N), same shape, float dtype (residual is added in float32).
        weight, eps, site, strict: as :func:`rms_norm`.
    Returns:
        (normed, s): both (..., N) in ``x.dtype``; ``s`` is the residual stream for the next layer.
    Raises:
        ValueError: shapes differ. Others as :func:`rms_norm`.
    """
    eps = _check(x, weight, eps)
    if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
        got = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise ValueError(f"residual shape {got} must equal x shape {tuple(x.shape)}")
    return FUSED_ADD_RMS_NORM.dispatch(x, residual, weight, eps, site=site, strict=strict, stacklevel=2)
