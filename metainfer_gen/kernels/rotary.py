"""Rotary position embedding, interleaved (GPT-J, Wan) and half-split (GPT-NeoX, Llama, DeepSeek) pairs.

For each pair ``(x1, x2)`` at rotary frequency ``i`` and position ``s``::

    out1 = x1 * cos[s, i] - x2 * sin[s, i]
    out2 = x1 * sin[s, i] + x2 * cos[s, i]

Interleaved pairs are ``(x[2i], x[2i+1])``; half-split pairs are ``(x[i], x[i + D/2])``. The tables hold one
value per pair, ``(S, D/2)``; a model that stores them repeated per element (Wan's ``freqs_cos`` of shape
``(1, S, 1, D)`` made with ``repeat_interleave_real=True``) passes ``freqs[0, :, 0, 0::2]``. Arithmetic is
float32 and the result is rounded once to ``x.dtype``, as diffusers' ``WanAttnProcessor.apply_rotary_emb`` does
(its bf16 inputs meet float32 tables) and as Hugging Face ``apply_rotary_pos_emb`` does in float32 models.

Sources: diffusers ``transformer_wan.py`` (``WanAttnProcessor``), transformers ``rotate_half``, vLLM
``rotary_embedding`` (``is_neox_style``).
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.common import (CompiledPath, contiguous_refusal, dtype_refusal, first_refusal,
                                          lazy_triton_kernel, row_bytes_refusal, triton_refusal)
from metainfer_gen.kernels.launch import launch
from metainfer_gen.kernels.registry import Op, register_op
from metainfer_gen.kernels.rotary_cpu import rope_cpp, rope_cpp_supports

__all__ = ["rope", "rope_reference"]


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (..., S, H, D), cos/sin (S, D/2) -> (..., S, H, D) in x.dtype."""
    xf = x.float()
    c = cos.float().unsqueeze(-2)  # (S, 1, D/2): broadcast over heads
    s = sin.float().unsqueeze(-2)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


# Bound on the first kernel build (triton is imported lazily); kernels look names up in module globals.
tl = triton = None


@lazy_triton_kernel
def _kernel():
    global tl, triton  # kernels resolve names through module globals (closures are not seen)
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(
        x_ptr,  # (T, H, D) contiguous input, T = prod(leading dims) * S tokens
        cos_ptr,  # (S, HALF) contiguous table
        sin_ptr,  # (S, HALF) contiguous table
        out_ptr,  # (T, H, D) contiguous output, x.dtype
        S,  # positions; token t uses table row t % S
        H,  # heads
        HALF,  # D / 2 rotary pairs per head
        INTERLEAVED: tl.constexpr,  # pairs (2i, 2i+1) if true, else (i, i + HALF)
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        pos = token % S
        h = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < H) & (i < HALF)
        base = token * H * 2 * HALF + h * 2 * HALF
        if INTERLEAVED:
            off1 = base + 2 * i
            off2 = off1 + 1
        else:
            off1 = base + i
            off2 = off1 + HALF
        c = tl.load(cos_ptr + pos * HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + off1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + off2, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + off1, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + off2, (x1 * s + x2 * c).to(out_ptr.dtype.element_ty), mask=mask)

    return rope_kernel


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    seq, heads, dim = x.shape[-3:]
    out = torch.empty_like(x)
    num_tokens = x.numel() // (heads * dim)
    if num_tokens > 0:
        half = dim // 2
        launch(_kernel(), (num_tokens,),
            x, cos, sin, out, seq, heads, half, INTERLEAVED=bool(interleaved),
            BLOCK_H=1 << max(heads - 1, 0).bit_length(), BLOCK_HALF=1 << max(half - 1, 0).bit_length(),
            num_warps=4,
        )
    return out


def _triton_supports(x, cos, sin, interleaved) -> str | None:
    return first_refusal(
        triton_refusal(x, cos, sin),
        dtype_refusal("x", x),
        dtype_refusal("cos", cos, (torch.float32,)),
        dtype_refusal("sin", sin, (torch.float32,)),
        contiguous_refusal("x", x),
        contiguous_refusal("cos", cos),
        contiguous_refusal("sin", sin),
        row_bytes_refusal("x token", x.shape[-1] * x.shape[-2], 4),
    )


def _example(device: str, dtype: torch.dtype, interleaved: bool = True):
    seq, heads, dim = 2048, 12, 128  # Wan 1.3B heads, one 2K-token chunk
    x = torch.randn(1, seq, heads, dim, device=device, dtype=dtype)
    angles = torch.rand(seq, dim // 2, device=device) * 6.28
    return (x, angles.cos(), angles.sin(), interleaved), {}


_compiled = CompiledPath(rope_reference)

ROPE = register_op(Op("rope", "rotary embedding (interleaved or half-split pairs)", _example))
ROPE.register("triton", rope_triton, _triton_supports, description="one program per token, all heads")
ROPE.register("cpp", rope_cpp, rope_cpp_supports, devices=("cpu",),
              description="C++ one pass per token, float32 arithmetic, no fused multiply-add (rotary_cpu)")
ROPE.register("compiled", _compiled, _compiled.refusal, description="torch.compile(reference), static shapes")
ROPE.register("torch", rope_reference, description="eager reference, float32 arithmetic")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, site: str | None = None,
         strict: bool | None = None) -> torch.Tensor:
    """Rotate query or key heads by position.

    Args:
        x: (..., S, H, D) float tensor, D even (Wan: (B, S, H, D); an LLM batch: (T, H, D) with S = T).
        cos, sin: (S, D/2) tables, one value per rotary pair (float32 on the Triton path).
        interleaved: True for pairs (2i, 2i+1) (Wan, GPT-J); False for (i, i + D/2) (Llama, NeoX, DeepSeek).
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        (..., S, H, D) in ``x.dtype``.
    Raises:
        ValueError: D odd, or table shapes not (S, D/2).
    Tolerance against :func:`rope_reference`: atol=rtol=1e-5 (float32), one bf16 ulp (bfloat16).
    """
    if not isinstance(x, torch.Tensor) or x.ndim < 3:
        raise ValueError(f"x must be (..., S, H, D); got {tuple(getattr(x, 'shape', ()))}")
    seq, _, dim = x.shape[-3:]
    if dim % 2:
        raise ValueError(f"head dim D={dim} must be even to form rotary pairs")
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (seq, dim // 2):
            raise ValueError(f"{name} shape {tuple(table.shape)} must be (S, D/2) = ({seq}, {dim // 2})")
    return ROPE.dispatch(x, cos, sin, bool(interleaved), site=site, strict=strict, stacklevel=2)
