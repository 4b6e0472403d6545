"""Triton paged MLA decode (flash-decoding): each program walks one split of a sequence's context in place.

Grid ``(B, ceil(N / 16), splits)``: program (b, h, s) takes sequence b's query for 16 heads, reads the context
positions of split s a tile of ``BLOCK_N`` tokens at a time straight from the paged cache (each position's block
looked up in the block table, so any page size works), keeps FlashAttention's running max, sum and accumulator in
float32, and writes its normalised partial output with its log-sum-exp. A decode batch is small, so the context is
split to fill the GPU (flash-decoding, Dao et al. 2023; FlashMLA and vLLM's ``triton_decode_attention`` split the
KV the same way); the partials merge by log-sum-exp in torch (a few ops on (B, N, splits) values). The split
count comes from tensor shapes only (the table width, not the lengths), so a CUDA graph can capture the step.
The tile is sparse MLA's (16 heads x rows of ``[c_kv, k_pe]``, the same online-softmax step,
:func:`metainfer_gen.kernels.sparse_attention.attend_rows_fn`), at 16 rows (:func:`paged_mla_decode_config`).
"""

from __future__ import annotations

import torch

from metainfer_gen import platform
from metainfer_gen.kernels.common import (contiguous_refusal, dtype_refusal, first_refusal, lazy_triton_kernel,
                                          triton_refusal)
from metainfer_gen.kernels.fp8_codec import fp8_bits, software_fp8
from metainfer_gen.kernels.fp8_quant import FP8_DTYPE
from metainfer_gen.kernels.launch import launch, target_arch
from metainfer_gen.kernels.sparse_attention import attend_rows_fn, sparse_mla_config

__all__ = ["decode_splits", "paged_mla_decode_config", "paged_mla_decode_supports", "paged_mla_decode_triton"]

TARGET_PROGRAMS = 264  # two waves of a 132-SM GPU (H100/H200); more splits only add merge work

# Bound on the first kernel build (triton is imported lazily); kernels look names up in module globals.
tl = triton = attend_rows = None


def _kernel():
    """The decode kernel for the current ``TRITON_INTERPRET`` setting, with the online-softmax tile step shared with
    sparse MLA (and the fp8 codec it calls) bound on every call, as :func:`sparse_attention._kernel` does."""
    global attend_rows  # kernels resolve names through module globals
    attend_rows = attend_rows_fn()
    return _build_kernel()


@lazy_triton_kernel
def _build_kernel():
    global tl, triton  # kernels resolve names through module globals
    import triton
    import triton.language as tl

    @triton.jit
    def paged_mla_decode_kernel(
        q_ptr,  # (B, N, R + P) contiguous absorbed queries
        kv_ptr,  # (S, row) flat cache rows (uint8 e4m3 codes when SOFT_FP8), unit stride in a row, row stride stride_kv
        table_ptr,  # (B, >= W) int64 block tables, unit stride within a row, row stride W
        lens_ptr,  # (B,) int64 context lengths
        out_ptr,  # (B, N, SPLITS, R) float32 partial outputs (normalised within the split)
        lse_ptr,  # (B, N, SPLITS) float32 log-sum-exp of each split, -inf when it holds no token
        N,
        R,  # value / latent width (kv_lora_rank)
        P,  # rope width (qk_rope_head_dim)
        W,  # block-table row stride (a slice of a wider table, as static decode's buffers, reads in place)
        stride_kv,
        block_size,
        tokens_per_split,
        num_splits,
        scale,
        UPCAST: tl.constexpr,  # dot in float32 (interpreter, fp32 and fp8 inputs); else the q dtype
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SOFT_FP8: tl.constexpr,  # fp8 rows decoded in software (no e4m3 conversion below sm_89, see fp8_codec)
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        r = tl.arange(0, BLOCK_R)
        p = tl.arange(0, BLOCK_P)
        dot_dtype = tl.float32 if UPCAST else q_ptr.dtype.element_ty
        q_base = q_ptr + b * N * (R + P) + h[:, None] * (R + P)
        q_lat = tl.load(q_base + r[None, :], mask=(h[:, None] < N) & (r[None, :] < R), other=0.0).to(dot_dtype)
        q_pe = tl.load(q_base + R + p[None, :], mask=(h[:, None] < N) & (p[None, :] < P), other=0.0).to(dot_dtype)
        length = tl.load(lens_ptr + b)
        begin = split * tokens_per_split
        end = tl.minimum(begin + tokens_per_split, length)
        m = tl.full((BLOCK_H,), -1.0e30, tl.float32)  # finite: a masked tile must not give inf - inf
        denom = tl.full((BLOCK_H,), 0.0, tl.float32)
        acc = tl.full((BLOCK_H, BLOCK_R), 0.0, tl.float32)
        for start in range(begin, end, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            valid = t < end
            block = tl.load(table_ptr + b * W + t // block_size, mask=valid, other=0)
            m, denom, acc = attend_rows(q_lat, q_pe, kv_ptr, block * block_size + t % block_size, valid, m, denom,
                                        acc, R, P, stride_kv, scale, BLOCK_R, BLOCK_P, SOFT_FP8)
        seen = denom > 0
        out = acc / tl.where(seen, denom, 1.0)[:, None]
        part = (b * N + h) * num_splits + split  # (BLOCK_H,) index into (B, N, SPLITS)
        tl.store(out_ptr + part[:, None] * R + r[None, :], out, mask=(h[:, None] < N) & (r[None, :] < R))
        tl.store(lse_ptr + part, tl.where(seen, m + tl.log(tl.where(seen, denom, 1.0)), float("-inf")),
                 mask=h < N)

    return paged_mla_decode_kernel


def paged_mla_decode_config(value_dim: int, rope_dim: int, upcast: bool, arch: int | None) -> dict:
    """Sparse MLA's tiles (:func:`~metainfer_gen.kernels.sparse_attention.sparse_mla_config`) with 16 rows per
    tile in every dtype: the block-table lookup per position costs registers, and DeepSeek-V3's bf16 tile of 32 rows
    on 8 warps took 255 registers and spilled 220-604 B on sm_80-sm_120, where 16 rows take 193-208 and none."""
    return {**sparse_mla_config(value_dim, rope_dim, upcast, arch), "BLOCK_N": 16}


def decode_splits(batch: int, head_programs: int, width_tokens: int, tile: int) -> int:
    """Splits of the context per (sequence, head group): enough programs for :data:`TARGET_PROGRAMS`, at least
    four tiles of ``tile`` tokens per split, at least 1."""
    wanted = -(-TARGET_PROGRAMS // max(1, batch * head_programs))
    return max(1, min(wanted, width_tokens // (4 * tile)))


def paged_mla_decode_triton(q: torch.Tensor, kv_rows: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, block_size: int, value_dim: int,
                            scale: float, software: bool | None = None) -> torch.Tensor:
    """Same arguments and result as :func:`metainfer_gen.kernels.paged_mla.paged_mla_decode`; ``software`` forces
    the sm_80 decode of fp8 rows on or off (None: from the device, as sparse MLA)."""
    batch, heads, dk = q.shape
    soft = kv_rows.dtype == FP8_DTYPE and software_fp8(kv_rows.device, software)
    if batch == 0:
        return q.new_empty(0, heads, value_dim)
    upcast = platform.triton_interpret_requested() or q.dtype == torch.float32 or kv_rows.dtype == FP8_DTYPE
    meta = paged_mla_decode_config(value_dim, dk - value_dim, upcast, target_arch(q.device))
    head_programs = -(-heads // meta["BLOCK_H"])
    width = block_tables.shape[1]
    splits = decode_splits(batch, head_programs, width * block_size, meta["BLOCK_N"])
    per_split = -(-(-(-width * block_size // splits)) // meta["BLOCK_N"]) * meta["BLOCK_N"]
    partial = torch.empty(batch, heads, splits, value_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch, heads, splits, device=q.device, dtype=torch.float32)
    launch(_kernel(), (batch, head_programs, splits),
           q, fp8_bits(kv_rows, soft), block_tables, context_lens, partial, lse, heads, value_dim, dk - value_dim,
           block_tables.stride(0),
           kv_rows.stride(0), block_size, per_split, splits, float(scale), UPCAST=upcast, SOFT_FP8=soft,
           **meta)
    weights = torch.softmax(lse, dim=-1)  # exp(lse_s - logsumexp over splits); empty splits weigh 0
    return (partial * weights[..., None]).sum(2).to(q.dtype)


def paged_mla_decode_supports(q, kv_rows, block_tables, context_lens, block_size, value_dim, scale) -> str | None:
    """None when the Triton kernel applies, else why not."""
    return first_refusal(
        triton_refusal(q, kv_rows, block_tables, context_lens),
        dtype_refusal("q", q),
        contiguous_refusal("q", q),
        None if block_tables.stride(-1) == 1 else f"block tables are strided within a row "
                                                  f"(stride {tuple(block_tables.stride())})",
        contiguous_refusal("context_lens", context_lens),
        None if kv_rows.stride(-1) == 1 else f"cache rows are strided (stride {tuple(kv_rows.stride())})",
        None if value_dim <= 1024 else f"kv_lora_rank {value_dim} over 1024: the accumulator would spill",
    )
