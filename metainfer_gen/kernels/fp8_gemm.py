"""FP8 block-scaled GEMM: ``y = x @ w.T`` with x in 1x128 groups and w in 128x128 tiles, float32 accumulation.

Per K block ``b`` the fp8 partial product ``x_q[:, b] @ w_q[:, b].T`` is taken in float32 and multiplied by the
activation scale of each row and the weight scale of the tile before it is added (DeepSeek-V3
``inference/kernel.py`` ``fp8_gemm_kernel``; DeepGEMM's scaling). The last K block and the last N tile may be
partial: the kernel masks the missing values to zero and still applies that block's scale (dropping it is the
classic bug, with errors near 1e4). Public engines refuse such shapes (DeepGEMM: ``N % 64`` and ``K % 128``); this
kernel takes any K and N. Below sm_89 (no fp8 MMA, no e4m3 in Triton) it decodes both tiles to fp16 in registers
(:mod:`~metainfer_gen.kernels.fp8_codec`) and takes fp16 dots: every e4m3 value and every product of two is exact
there, so only the fp32 summation differs, as on sm_89+.

The CPU has no block-scaled ``_scaled_mm`` (row-wise and per-tensor only), so the torch reference dequantises the
activations and, one group of 128-row weight tiles at a time (about :data:`DEQUANT_BYTES` of float32), the weight,
and multiplies each group once: the same products, summed in another order, and never the whole weight in float32
(an fp8 model stays fp8 in memory; only the group in hand is dequantised).
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.common import contiguous_refusal, first_refusal, triton_refusal
from metainfer_gen.kernels.fp8_codec import HARDWARE_FP8_ARCH, fp8_bits, lazy_fp8_kernel, software_fp8
from metainfer_gen.kernels.fp8_quant import (FP8_BLOCK, FP8_DTYPE, check_fp8_weight, dequantize_fp8_weight_reference,
                                             fp8_act_quant, quantize_fp8_weight)
from metainfer_gen.kernels.launch import launch, target_arch
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["fp8_block_gemm", "fp8_block_gemm_reference", "fp8_linear"]


DEQUANT_BYTES = 16 << 20


def fp8_block_gemm_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                             out_dtype: torch.dtype) -> torch.Tensor:
    """(M, K) fp8 + (M, ceil(K/128)) scales, (N, K) fp8 + (ceil(N/128), ceil(K/128)) scales -> (M, N) out_dtype.

    The weight is dequantised in groups of whole 128-row tiles of at most :data:`DEQUANT_BYTES` float32 (at least
    one tile row), each multiplied as it is made (DeepSeek-V3 ``weight_dequant`` per tile, applied per group).
    """
    (m, k), n = x_q.shape, w_q.shape[0]
    x = x_q.float() * x_scale.repeat_interleave(FP8_BLOCK, 1)[:, :k]
    rows = max(1, DEQUANT_BYTES // (4 * FP8_BLOCK * max(k, 1))) * FP8_BLOCK
    y = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    for start in range(0, n, rows):
        tiles = slice(start // FP8_BLOCK, -(-min(start + rows, n) // FP8_BLOCK))
        w = dequantize_fp8_weight_reference(w_q[start:start + rows], w_scale[tiles])
        y[:, start:start + rows] = x @ w.T
    return y


# Bound on the first kernel build (triton is imported lazily) and, for the codec, on every _kernel() call
# (lazy_fp8_kernel); kernels look names up in module globals.
tl = triton = e4m3_to_fp16 = fp32_to_e4m3 = None


@lazy_fp8_kernel
def _kernel():
    global tl, triton  # kernels resolve names through module globals (closures are not seen)
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_gemm_kernel(
        x_ptr,  # (M, K) fp8 activations (uint8 codes when SOFT_FP8), contiguous
        xs_ptr,  # (M, KB) float32 activation scales, KB = ceil(K / 128)
        w_ptr,  # (N, K) fp8 weight (uint8 codes when SOFT_FP8), contiguous
        ws_ptr,  # (ceil(N / 128), KB) float32 weight scales
        y_ptr,  # (M, N) output, contiguous
        M,
        N,
        K,
        num_kb,  # ceil(K / 128)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,  # divides 128, so a tile of N uses one row of weight scales
        BLOCK_K: tl.constexpr,  # 128, the scale block
        SOFT_FP8: tl.constexpr,  # decode to fp16 in software and take fp16 dots (no fp8 MMA below sm_89)
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        scale_row = (pid_n * BLOCK_N) // BLOCK_K
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # not tl.zeros: see common._sum_combine
        for kb in range(0, num_kb):
            k = kb * BLOCK_K + ks
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + k[None, :],
                        mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
            b = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + k[None, :],
                        mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
            if SOFT_FP8:  # e4m3 values are exact in fp16: the fp16 MMA forms the same products in fp32
                a = e4m3_to_fp16(a)
                b = e4m3_to_fp16(b)
            a_s = tl.load(xs_ptr + rows * num_kb + kb, mask=rows < M, other=0.0)
            b_s = tl.load(ws_ptr + scale_row * num_kb + kb)
            acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s  # the partial last K block keeps its scales
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    return fp8_gemm_kernel


def fp8_gemm_config(m: int, n: int, arch: int | None) -> dict:
    """Meta-parameters for an (m, K) x (n, K) product on sm_``arch`` (None: no GPU, the interpreter).

    Each 128-wide K step keeps (BLOCK_M + BLOCK_N) x 128 fp8 values and their 64-bit addresses live: the earlier
    64 x 128 tiles (16 x 128 at decode) on 4 warps needed 255 registers and spilled 1.3-3.8 KB on sm_89 and sm_90
    (``benchmarks/triton_aot.py``); 32 x 32 tiles on 8 warps (182-186 registers) and 16 x 32 on 4 warps at decode
    spill nothing on sm_89, sm_90 and sm_120 (32 x 32 on 4 warps spilled 36 B on sm_90; 64 x 64 on 8 warps 252-524
    B). Small tiles cost reuse; larger ones need the K loop split below the scale block.
    Below sm_89 (no fp8 MMA) the tiles are decoded to fp16 in registers (``fp8_codec``) for fp16 MMAs: on sm_80
    16 x 32 on 4 warps takes all 255 registers (no spills yet), on 8 warps 160; 32 x 32 on 8 warps 198 (on 4
    warps it spills 24 B), so the decode tile gets 8 warps there.
    """
    block_m = 16 if m <= 16 else 32
    software = arch is not None and arch < HARDWARE_FP8_ARCH
    return dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=FP8_BLOCK, num_warps=4 if block_m == 16 and not software else 8)


def fp8_block_gemm_triton(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                          out_dtype: torch.dtype, software: bool | None = None) -> torch.Tensor:
    """The Triton form of :func:`fp8_block_gemm`; ``software`` forces the sm_80 e4m3 decode and fp16 dots on or
    off (None: from the device, :func:`~metainfer_gen.kernels.fp8_codec.software_fp8`)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    soft = software_fp8(x_q.device, software)
    y = torch.empty(m, n, device=x_q.device, dtype=out_dtype)
    if m and n:
        meta = fp8_gemm_config(m, n, target_arch(x_q.device))
        grid = (-(-m // meta["BLOCK_M"]), -(-n // meta["BLOCK_N"]))
        launch(_kernel(), grid, fp8_bits(x_q, soft), x_scale, fp8_bits(w_q, soft), w_scale, y, m, n, k,
               x_scale.shape[1], SOFT_FP8=soft, **meta)
    return y


def _triton_supports(x_q, x_scale, w_q, w_scale, out_dtype) -> str | None:
    return first_refusal(
        triton_refusal(x_q, x_scale, w_q, w_scale),
        contiguous_refusal("x_q", x_q), contiguous_refusal("x_scale", x_scale), contiguous_refusal("w_q", w_q),
        contiguous_refusal("w_scale", w_scale),
    )


def _example(device: str, dtype: torch.dtype):
    w_q, w_s = quantize_fp8_weight(torch.randn(2048, 7168))
    x_q, x_s = fp8_act_quant(torch.randn(256, 7168))
    return (x_q.to(device), x_s.to(device), w_q.to(device), w_s.to(device), dtype), {}


FP8_BLOCK_GEMM = register_op(Op("fp8_block_gemm", "e4m3 x e4m3 GEMM, 1x128 / 128x128 scales, fp32 accumulate",
                                _example))
FP8_BLOCK_GEMM.register("triton", fp8_block_gemm_triton, _triton_supports,
                        description="per-K-block fp8 dot, scaled and accumulated in fp32; partial blocks masked")
FP8_BLOCK_GEMM.register("torch", fp8_block_gemm_reference, description="dequantise per block, one fp32 matmul")


def fp8_block_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16, *, site: str | None = None,
                   strict: bool | None = None) -> torch.Tensor:
    """Block-scaled fp8 GEMM ``y = dequant(x_q) @ dequant(w_q).T``.

    Args:
        x_q: (M, K) float8_e4m3fn; x_scale: (M, ceil(K/128)) float32 (from :func:`fp8_act_quant`).
        w_q: (N, K) float8_e4m3fn; w_scale: (ceil(N/128), ceil(K/128)) float32 (``weight_scale_inv``).
        out_dtype: dtype of y.
    Returns:
        (M, N) ``out_dtype``.
    Raises:
        ValueError: dtypes or shapes inconsistent (K differs, scale grids that do not cover partial blocks).
    Tolerance against :func:`fp8_block_gemm_reference`: relative Frobenius error 1e-5 in float32 (summation order).
    """
    check_fp8_weight(w_q, w_scale)
    if x_q.ndim != 2 or x_q.dtype != FP8_DTYPE or x_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"x_q must be (M, K={w_q.shape[1]}) float8_e4m3fn; got {tuple(x_q.shape)} {x_q.dtype}")
    if tuple(x_scale.shape) != (x_q.shape[0], w_scale.shape[1]):
        raise ValueError(f"x_scale {tuple(x_scale.shape)} must be (M, ceil(K/128)) = "
                         f"{(x_q.shape[0], w_scale.shape[1])}")
    return FP8_BLOCK_GEMM.dispatch(x_q, x_scale, w_q, w_scale, out_dtype, site=site, strict=strict, stacklevel=2)


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
               site: str | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with W in fp8 128x128 blocks: x (..., K) is quantised per 1x128 group, multiplied
    with :func:`fp8_block_gemm`, and returned as (..., N) in ``x.dtype`` (DeepSeek-V3 ``inference/model.py``
    ``linear`` for fp8 weights).

    Raises:
        ValueError: see :func:`fp8_block_gemm`.
    """
    lead = x.shape[:-1]
    x_q, x_scale = fp8_act_quant(x.reshape(-1, x.shape[-1]), site=site)
    y = fp8_block_gemm(x_q, x_scale, w_q, w_scale, x.dtype, site=site)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w_q.shape[0])
