"""DiT adaptive LayerNorm: the modulate and gated-residual steps of a Wan transformer block.

    adaln_modulate(x, scale, shift) = LayerNorm(x) * (1 + scale) + shift      (no affine LayerNorm)
    gated_residual(residual, y, gate) = residual + y * gate

Both compute in float32 and round once to the dtype of ``x`` / ``residual``, exactly as diffusers'
``WanTransformerBlock.forward`` writes them::

    norm_hidden_states = (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)

``scale``, ``shift`` and ``gate`` broadcast over the sequence: (B, 1, N) for Wan 2.1 and Wan 2.2 14B (one timestep
per sample) or (B, S, N) for Wan 2.2 TI2V (one timestep per token); they may be strided views (the ``chunk`` of
the six-way modulation table), as long as the last dimension has unit stride.

Sources: diffusers ``models/transformers/transformer_wan.py`` (``WanTransformerBlock``, ``FP32LayerNorm``),
Triton tutorial ``05-layer-norm.py`` (one program per row, two-pass mean/variance in registers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metainfer_gen.kernels.common import (CompiledPath, _sum_combine, contiguous_refusal, dtype_refusal,
                                          first_refusal, lazy_triton_kernel, row_bytes_refusal, triton_refusal)
from metainfer_gen.kernels.launch import launch
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["adaln_modulate", "adaln_modulate_reference", "gated_residual", "gated_residual_reference"]


# --- torch references ------------------------------------------------------------------------------------------

def adaln_modulate_reference(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., N); scale/shift broadcastable to x -> (..., N) in x.dtype."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1 + scale.float()) + shift.float()).to(x.dtype)


def gated_residual_reference(residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """residual (..., N), y like residual, gate broadcastable -> (..., N) in residual.dtype."""
    return (residual.float() + y.float() * gate.float()).to(residual.dtype)


# --- Triton kernels --------------------------------------------------------------------------------------------

# Bound on the first kernel build (triton is imported lazily); kernels look names up in module globals.
add = tl = triton = None


@lazy_triton_kernel
def _kernels():
    global add, tl, triton  # kernels resolve names through module globals (closures are not seen)
    import triton
    import triton.language as tl

    add = _sum_combine(tl)

    @triton.jit
    def adaln_modulate_kernel(
        x_ptr,  # (B*S, N) contiguous rows
        scale_ptr,  # scale[b, s, :] at b * stride_scale_b + s * stride_scale_s (stride 0 = broadcast)
        shift_ptr,  # shift[b, s, :] likewise
        out_ptr,  # (B*S, N) contiguous output, x.dtype
        S,
        N,
        stride_scale_b,
        stride_scale_s,
        stride_shift_b,
        stride_shift_s,
        eps,
        BLOCK_N: tl.constexpr,  # next power of two >= N
    ):
        row = tl.program_id(0).to(tl.int64)
        b = row // S
        s = row % S
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.reduce(x, 0, add) / N
        centered = tl.where(mask, x - mean, 0.0)
        rstd = tl.rsqrt(tl.reduce(centered * centered, 0, add) / N + eps)
        scale = tl.load(scale_ptr + b * stride_scale_b + s * stride_scale_s + cols, mask=mask, other=0.0)
        shift = tl.load(shift_ptr + b * stride_shift_b + s * stride_shift_s + cols, mask=mask, other=0.0)
        y = centered * rstd * (1.0 + scale.to(tl.float32)) + shift.to(tl.float32)
        tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_residual_kernel(
        res_ptr,  # (B*S, N) contiguous residual rows
        y_ptr,  # (B*S, N) contiguous branch output rows
        gate_ptr,  # gate[b, s, :] at b * stride_gate_b + s * stride_gate_s (stride 0 = broadcast)
        out_ptr,  # (B*S, N) contiguous output, residual.dtype
        S,
        N,
        stride_gate_b,
        stride_gate_s,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        b = row // S
        s = row % S
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        r = tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + b * stride_gate_b + s * stride_gate_s + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, (r + y * g).to(out_ptr.dtype.element_ty), mask=mask)

    return adaln_modulate_kernel, gated_residual_kernel


def _as_bsn(x: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """View x as (B, S, N) and expand each parameter to it (stride 0 along broadcast dimensions)."""
    x3 = x.unsqueeze(0) if x.ndim == 2 else x
    return x3, [p.expand(x.shape).unsqueeze(0) if x.ndim == 2 else p.expand(x3.shape) for p in params]


def _block(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def adaln_modulate_triton(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    x3, (sc, sh) = _as_bsn(x, scale, shift)
    batch, seq, n = x3.shape
    out = torch.empty_like(x3)
    if x3.numel() > 0:
        block = _block(n)
        launch(_kernels()[0], (batch * seq,),
            x3, sc, sh, out, seq, n, sc.stride(0), sc.stride(1), sh.stride(0), sh.stride(1), eps,
            BLOCK_N=block, num_warps=min(max(block // 256, 1), 8),
        )
    return out.view(x.shape)


def gated_residual_triton(residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    r3, (g,) = _as_bsn(residual, gate)
    batch, seq, n = r3.shape
    out = torch.empty_like(r3)
    if r3.numel() > 0:
        block = _block(n)
        launch(_kernels()[1], (batch * seq,),
            r3, y, g, out, seq, n, g.stride(0), g.stride(1), BLOCK_N=block, num_warps=min(max(block // 256, 1), 8),
        )
    return out.view(residual.shape)


def _param_refusal(name: str, p: torch.Tensor) -> str | None:
    if p.stride(-1) != 1 and p.shape[-1] != 1:
        return f"{name} last dimension is strided (stride {p.stride(-1)}); the kernel reads rows of unit stride"
    return None


def _ndim_refusal(x: torch.Tensor) -> str | None:
    if x.ndim in (2, 3):
        return None
    return f"x has {x.ndim} dims; the Triton kernel takes (B, S, N) or (M, N)"


def _modulate_triton_supports(x, scale, shift, eps) -> str | None:
    return first_refusal(
        triton_refusal(x, scale, shift),
        _ndim_refusal(x),
        dtype_refusal("x", x),
        dtype_refusal("scale", scale),
        dtype_refusal("shift", shift),
        contiguous_refusal("x", x),
        _param_refusal("scale", scale),
        _param_refusal("shift", shift),
        row_bytes_refusal("x", x.shape[-1], 4),
    )


def _gated_triton_supports(residual, y, gate) -> str | None:
    return first_refusal(
        triton_refusal(residual, y, gate),
        _ndim_refusal(residual),
        dtype_refusal("residual", residual),
        dtype_refusal("y", y),
        dtype_refusal("gate", gate),
        contiguous_refusal("residual", residual),
        contiguous_refusal("y", y),
        _param_refusal("gate", gate),
        row_bytes_refusal("residual", residual.shape[-1], 4),
    )


# --- registration and public API -------------------------------------------------------------------------------

def _modulate_example(device: str, dtype: torch.dtype):
    x = torch.randn(1, 2048, 1536, device=device, dtype=dtype)  # Wan 1.3B width, a 2K-token chunk
    table = torch.randn(1, 6, 1536, device=device)  # float32 modulation, chunked as in the block
    shift, scale = table[:, 0:1], table[:, 1:2]
    return (x, scale, shift, 1e-6), {}


def _gated_example(device: str, dtype: torch.dtype):
    (x, scale, _, _), _ = _modulate_example(device, dtype)
    return (x, torch.randn_like(x), scale), {}


_modulate_compiled = CompiledPath(adaln_modulate_reference)
_gated_compiled = CompiledPath(gated_residual_reference)

ADALN_MODULATE = register_op(Op("adaln_modulate", "LayerNorm (no affine) * (1 + scale) + shift", _modulate_example))
ADALN_MODULATE.register("triton", adaln_modulate_triton, _modulate_triton_supports,
                        description="one program per row, broadcast scale/shift by stride")
ADALN_MODULATE.register("compiled", _modulate_compiled, _modulate_compiled.refusal,
                        description="torch.compile(reference), static shapes")
ADALN_MODULATE.register("torch", adaln_modulate_reference, description="eager reference, float32")

GATED_RESIDUAL = register_op(Op("gated_residual", "residual + y * gate", _gated_example))
GATED_RESIDUAL.register("triton", gated_residual_triton, _gated_triton_supports,
                        description="one program per row, broadcast gate by stride")
GATED_RESIDUAL.register("compiled", _gated_compiled, _gated_compiled.refusal,
                        description="torch.compile(reference), static shapes")
GATED_RESIDUAL.register("torch", gated_residual_reference, description="eager reference, float32")


def _check_broadcast(name: str, p: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a tensor; got {type(p).__name__}")
    if p.ndim > x.ndim or p.shape[-1] != x.shape[-1]:
        raise ValueError(f"{name} shape {tuple(p.shape)} must broadcast to {tuple(x.shape)} with last dim "
                         f"{x.shape[-1]}")
    try:
        if torch.broadcast_shapes(p.shape, x.shape) != x.shape:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"{name} shape {tuple(p.shape)} does not broadcast to {tuple(x.shape)}") from None


def adaln_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6, *,
                   site: str | None = None, strict: bool | None = None) -> torch.Tensor:
    """``LayerNorm(x) * (1 + scale) + shift`` (LayerNorm without affine), rounded once to ``x.dtype``.

    Args:
        x: (B, S, N) or (M, N) hidden states, float (Wan: bf16 or fp32).
        scale, shift: broadcastable to x, last dim N, any float dtype (Wan: float32 (B, 1, N) or (B, S, N)).
        eps: LayerNorm epsilon (Wan blocks: 1e-6).
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        Same shape as x, ``x.dtype``.
    Raises:
        TypeError/ValueError: non-tensor or non-broadcastable scale/shift.
    Tolerance against :func:`adaln_modulate_reference`: atol=rtol=1e-5 (float32), one bf16 ulp (bfloat16).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 1:
        raise TypeError("x must be a floating tensor")
    _check_broadcast("scale", scale, x)
    _check_broadcast("shift", shift, x)
    return ADALN_MODULATE.dispatch(x, scale, shift, float(eps), site=site, strict=strict, stacklevel=2)


def gated_residual(residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, *, site: str | None = None,
                   strict: bool | None = None) -> torch.Tensor:
    """``residual + y * gate`` in float32, rounded once to ``residual.dtype``.

    Args:
        residual: (B, S, N) or (M, N) residual stream.
        y: same shape as residual (the attention or feed-forward output), any float dtype.
        gate: broadcastable to residual, last dim N (Wan: float32 (B, 1, N) or (B, S, N)).
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        Same shape as residual, ``residual.dtype``.
    Raises:
        ValueError: y's shape differs from residual's, or gate does not broadcast.
    Tolerance against :func:`gated_residual_reference`: atol=rtol=1e-6 (float32; one rounding either way),
    one bf16 ulp (bfloat16).
    """
    if not isinstance(residual, torch.Tensor) or not residual.is_floating_point():
        raise TypeError("residual must be a floating tensor")
    if not isinstance(y, torch.Tensor) or y.shape != residual.shape:
        raise ValueError(f"y shape {tuple(getattr(y, 'shape', ()))} must equal residual shape "
                         f"{tuple(residual.shape)}")
    _check_broadcast("gate", gate, residual)
    return GATED_RESIDUAL.dispatch(residual, y, gate, site=site, strict=strict, stacklevel=2)
