"""FP8 (e4m3fn) block scaling: activations in 1x128 groups, weights in 128x128 blocks, and weight dequant.

DeepSeek-V3's release format (``inference/kernel.py``: ``act_quant``, ``weight_dequant``): every group of 128
consecutive values along K of an activation row, and every 128x128 tile of a weight, shares one float32 scale,
``scale = amax / 448`` (448 = largest e4m3fn value), so ``value ~= fp8 * scale``. Checkpoints store the weight
scale as ``weight_scale_inv`` (the name is historical: it is multiplied, not divided). A last group or tile that
is partial (K or N not a multiple of 128, or a tensor-parallel shard that is not) has its own scale over the
values that exist: it is never dropped and never borrowed from a neighbour.

Two ops go through the registry (:func:`fp8_act_quant`, :func:`fp8_weight_dequant`), each a Triton kernel plus
this file's torch reference. Weight quantisation (:func:`quantize_fp8_weight`) runs once at load time and has
only the torch form. The Triton activation kernel casts to fp8 in the kernel on a GPU; under
``TRITON_INTERPRET=1`` (whose in-kernel fp8 cast is wrong for about 2.5% of values) it stores the scaled float32
values and torch casts them, so the interpreter tests check the kernel's grouping and scales bit-exactly. Below
sm_89 (sm_80, sm_86: Triton has no e4m3 there) both kernels work on the uint8 codes and convert in software
(:mod:`~metainfer_gen.kernels.fp8_codec`, bit-exact with torch's casts); the interpreter tests force that path too.
"""

from __future__ import annotations

import torch

from metainfer_gen import platform
from metainfer_gen.kernels.common import _max_combine, contiguous_refusal, dtype_refusal, first_refusal, triton_refusal
from metainfer_gen.kernels.fp8_codec import fp8_bits, lazy_fp8_kernel, software_fp8
from metainfer_gen.kernels.launch import launch
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["FP8_BLOCK", "FP8_DTYPE", "FP8_MAX", "check_fp8_weight", "dequantize_fp8_weight_reference", "fp8_act_quant",
           "fp8_act_quant_reference", "fp8_weight_dequant", "quantize_fp8_weight"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128
# An all-zero group would get scale 0 and divide by it; DeepSeek's act_quant clamps amax the same way.
_MIN_AMAX = 1e-4


def _num_blocks(size: int) -> int:
    return -(-size // FP8_BLOCK)


def fp8_act_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (q (M, K) float8_e4m3fn, scale (M, ceil(K/128)) float32); ``x ~= q * scale``."""
    m, k = x.shape
    groups = torch.nn.functional.pad(x.float(), (0, (-k) % FP8_BLOCK)).view(m, -1, FP8_BLOCK)
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(_MIN_AMAX) / FP8_MAX
    q = (groups / scale).to(FP8_DTYPE).view(m, -1)[:, :k]
    return q.contiguous(), scale.squeeze(-1)


def quantize_fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight (N, K) float -> (q (N, K) float8_e4m3fn, scale_inv (ceil(N/128), ceil(K/128)) float32).

    Each 128x128 tile (the last ones partial when N or K is not a multiple of 128) gets ``amax / 448``; an
    all-zero tile gets a tiny positive scale instead of 0. Source: DeepSeek-V3 ``inference/fp8_cast_bf16.py``
    (the inverse of its ``weight_dequant``); vLLM ``per_block_cast_to_fp8``.

    Raises:
        ValueError: weight is not 2-D.
    """
    if weight.ndim != 2:
        raise ValueError(f"weight must be (N, K); got {tuple(weight.shape)}")
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, (-k) % FP8_BLOCK, 0, (-n) % FP8_BLOCK))
    tiles = padded.view(_num_blocks(n), FP8_BLOCK, _num_blocks(k), FP8_BLOCK)
    scale = tiles.abs().amax((1, 3), keepdim=True).clamp_min(_MIN_AMAX) / FP8_MAX
    q = (tiles / scale).to(FP8_DTYPE).view(padded.shape)[:n, :k].contiguous()
    return q, scale.view(_num_blocks(n), _num_blocks(k))


def dequantize_fp8_weight_reference(weight: torch.Tensor, scale_inv: torch.Tensor,
                                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 (N, K) with ``scale_inv`` (ceil(N/128), ceil(K/128)) -> (N, K) ``dtype``; partial tiles keep their scale
    (DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``)."""
    n, k = weight.shape
    scales = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return (weight.float() * scales).to(dtype)


# Bound on the first kernel build (triton is imported lazily) and, for the codec, on every _kernel() call
# (lazy_fp8_kernel); kernels look names up in module globals.
tl = triton = max_combine = e4m3_to_fp16 = fp32_to_e4m3 = None


@lazy_fp8_kernel
def _kernels():
    global tl, triton, max_combine  # kernels resolve names through module globals (closures are not seen)
    import triton
    import triton.language as tl

    # tl.max / tl.sum / tl.cdiv / tl.zeros are @triton.jit helpers the interpreter refuses to call when triton was
    # imported before TRITON_INTERPRET was set (see common._sum_combine): reduce with combine functions instead.
    max_combine = _max_combine(tl)

    @triton.jit
    def act_quant_kernel(
        x_ptr,  # (M, K) float activations, row stride stride_x
        y_ptr,  # (M, K) contiguous output: uint8 e4m3 codes (SOFT_FP8), fp8 (STORE_FP8), else float32 (torch casts)
        s_ptr,  # (M, KG) float32 scales, contiguous
        K,
        KG,  # ceil(K / 128) groups per row
        stride_x,
        MIN_AMAX,
        FP8_MAX: tl.constexpr,
        GROUP: tl.constexpr,  # 128 values per scale
        STORE_FP8: tl.constexpr,
        SOFT_FP8: tl.constexpr,  # encode in software (no e4m3 conversion below sm_89, see fp8_codec)
    ):
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        cols = group * GROUP + tl.arange(0, GROUP)
        mask = cols < K  # the last group of a row may be partial
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.reduce(tl.abs(x), 0, max_combine), MIN_AMAX) / FP8_MAX
        y = x / scale
        if SOFT_FP8:
            y = fp32_to_e4m3(y)
        elif STORE_FP8:
            y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * K + cols, y, mask=mask)
        tl.store(s_ptr + row * KG + group, scale)

    @triton.jit
    def weight_dequant_kernel(
        w_ptr,  # (N, K) fp8 weight (uint8 codes when SOFT_FP8), contiguous
        s_ptr,  # (ceil(N/128), ceil(K/128)) float32 scales, contiguous
        y_ptr,  # (N, K) output in the requested dtype, contiguous
        N,
        K,
        KB,  # ceil(K / 128) scale columns
        BLOCK: tl.constexpr,  # 128: one program per weight tile
        SOFT_FP8: tl.constexpr,  # decode in software (see fp8_codec)
    ):
        bn = tl.program_id(0)
        bk = tl.program_id(1)
        rows = bn * BLOCK + tl.arange(0, BLOCK)[:, None]
        cols = bk * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = (rows < N) & (cols < K)  # partial last tiles keep their own scale
        w = tl.load(w_ptr + rows.to(tl.int64) * K + cols, mask=mask)  # masked values are never stored
        w = (e4m3_to_fp16(w) if SOFT_FP8 else w).to(tl.float32)
        scale = tl.load(s_ptr + bn * KB + bk)
        tl.store(y_ptr + rows.to(tl.int64) * K + cols, (w * scale).to(y_ptr.dtype.element_ty), mask=mask)

    return act_quant_kernel, weight_dequant_kernel


# A 128 x 128 tile on 4 warps holds 128 values and their 64-bit addresses per thread: 255 registers and 1.2-1.8 KB
# of spills on sm_89/sm_90; 16 warps take 109 registers, no spills (benchmarks/triton_aot.py). The software decode
# (below sm_89) on 16 warps hits the 128-register cap of a 512-thread block and spilled 16 B on sm_86; 32 warps take
# 32-45 registers there, no spills. Keyed by the SOFT_FP8 flag.
WEIGHT_DEQUANT_WARPS = {False: 16, True: 32}


def fp8_act_quant_triton(x: torch.Tensor, software: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton form of :func:`fp8_act_quant`; ``software`` forces the sm_80 e4m3 encode on or off (None: from
    the device, :func:`~metainfer_gen.kernels.fp8_codec.software_fp8`)."""
    m, k = x.shape
    soft = software_fp8(x.device, software)
    store_fp8 = soft or not platform.triton_interpret_requested()
    y = torch.empty(m, k, device=x.device, dtype=FP8_DTYPE if store_fp8 else torch.float32)
    scale = torch.empty(m, _num_blocks(k), device=x.device, dtype=torch.float32)
    if m and k:
        launch(_kernels()[0], (m, _num_blocks(k)), x, fp8_bits(y, soft), scale, k, _num_blocks(k), x.stride(0),
               _MIN_AMAX, FP8_MAX=FP8_MAX, GROUP=FP8_BLOCK, STORE_FP8=store_fp8 and not soft, SOFT_FP8=soft,
               num_warps=4)
    return (y if store_fp8 else y.to(FP8_DTYPE)), scale


def fp8_weight_dequant_triton(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                              software: bool | None = None) -> torch.Tensor:
    """The Triton form of :func:`fp8_weight_dequant`; ``software`` as in :func:`fp8_act_quant_triton`."""
    n, k = weight.shape
    soft = software_fp8(weight.device, software)
    out = torch.empty(n, k, device=weight.device, dtype=dtype)
    if n and k:
        launch(_kernels()[1], (_num_blocks(n), _num_blocks(k)), fp8_bits(weight, soft), scale_inv, out, n, k,
               _num_blocks(k), BLOCK=FP8_BLOCK, SOFT_FP8=soft, num_warps=WEIGHT_DEQUANT_WARPS[soft])
    return out


def _act_supports(x) -> str | None:
    return first_refusal(triton_refusal(x), dtype_refusal("x", x),
                         None if x.stride(-1) == 1 else f"x rows are strided (stride {tuple(x.stride())})")


def _dequant_supports(weight, scale_inv, dtype=torch.float32) -> str | None:
    return first_refusal(triton_refusal(weight, scale_inv), contiguous_refusal("weight", weight),
                         contiguous_refusal("scale_inv", scale_inv))


def _act_example(device: str, dtype: torch.dtype):
    return (torch.randn(512, 7168, device=device, dtype=dtype),), {}


def _dequant_example(device: str, dtype: torch.dtype):
    q, s = quantize_fp8_weight(torch.randn(1536, 7168))
    return (q.to(device), s.to(device), dtype), {}


FP8_ACT_QUANT = register_op(Op("fp8_act_quant", "activations to e4m3 with one scale per 1x128 group", _act_example))
FP8_ACT_QUANT.register("triton", fp8_act_quant_triton, _act_supports, description="one program per (row, group)")
FP8_ACT_QUANT.register("torch", fp8_act_quant_reference, description="padded groups, amax / 448")

FP8_WEIGHT_DEQUANT = register_op(Op("fp8_weight_dequant", "e4m3 weight with 128x128 scales to a float dtype",
                                    _dequant_example))
FP8_WEIGHT_DEQUANT.register("triton", fp8_weight_dequant_triton, _dequant_supports,
                            description="one program per 128x128 tile, masked partial tiles")
FP8_WEIGHT_DEQUANT.register("torch", dequantize_fp8_weight_reference, description="scales expanded and cut to (N, K)")


def fp8_act_quant(x: torch.Tensor, *, site: str | None = None,
                  strict: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations per 1x128 group along K.

    Args:
        x: (M, K) float32/bfloat16/float16, rows with unit stride.
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        (q, scale): q (M, K) float8_e4m3fn, scale (M, ceil(K/128)) float32 with ``x ~= q * scale``.
    Raises:
        ValueError: x not 2-D.
    Exact: both paths compute the same scale and round once to e4m3 (interpreter: cast in torch).
    """
    if x.ndim != 2:
        raise ValueError(f"x must be (M, K); got {tuple(x.shape)}")
    return FP8_ACT_QUANT.dispatch(x, site=site, strict=strict, stacklevel=2)


def fp8_weight_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                       site: str | None = None, strict: bool | None = None) -> torch.Tensor:
    """Dequantise an fp8 weight with 128x128 block scales.

    Args:
        weight: (N, K) float8_e4m3fn. scale_inv: (ceil(N/128), ceil(K/128)) float32.
        dtype: output dtype.
    Returns:
        (N, K) ``dtype``, ``weight * scale`` of its tile.
    Raises:
        ValueError: weight not fp8 2-D, or scale_inv of the wrong shape (e.g. a scale grid that drops the
            partial last tile: ``K // 128`` columns instead of ``ceil(K / 128)``).
    Exact in float32 (one multiply per value on both paths).
    """
    check_fp8_weight(weight, scale_inv)
    return FP8_WEIGHT_DEQUANT.dispatch(weight, scale_inv, dtype, site=site, strict=strict, stacklevel=2)


def check_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Raise ValueError unless weight is (N, K) fp8 and scale_inv is (ceil(N/128), ceil(K/128))."""
    if weight.ndim != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be (N, K) float8_e4m3fn; got {tuple(weight.shape)} {weight.dtype}")
    expected = (_num_blocks(weight.shape[0]), _num_blocks(weight.shape[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not cover weight {tuple(weight.shape)} in "
                         f"128x128 tiles; expected {expected} (partial last tiles included)")
