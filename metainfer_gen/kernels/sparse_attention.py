"""Sparse MLA: each query attends only to the latent-cache rows the indexer selected for it.

MLA in its absorbed form (DeepSeek-V2 paper, eq. 9-11): a query is ``[q_nope @ W_UK, q_pe]`` (N heads, r + dr
wide) and scores directly against cache rows ``[c_kv, k_pe]``; the value is the latent ``c_kv`` itself (W_UV is
applied by the caller). DeepSeek-V3.2 runs prefill and decode in this form over the top-k rows (FlashMLA's sparse
kernels; vLLM ``FlashMLASparseBackend``), so the cost per query grows with top-k, not with the context.

Indices are flat cache slots (``block * page_size + offset``), ``-1`` for padding. Public sparse kernels also
require a 64-token page; this kernel gathers row by row through the slot, so the engine converts the indexer's
token positions to slots for any page size (the realignment the audit reports).

The Triton kernel is one program per (query token, 16 heads), an online softmax over blocks of selected rows.
"""

from __future__ import annotations

import torch

from metainfer_gen import platform
from metainfer_gen.kernels.common import (_max_combine, _sum_combine, contiguous_refusal, dtype_refusal, first_refusal,
                                          pow2_at_least, triton_refusal)
from metainfer_gen.kernels.fp8_codec import fp8_bits, lazy_fp8_kernel, software_fp8
from metainfer_gen.kernels.fp8_quant import FP8_DTYPE
from metainfer_gen.kernels.launch import launch, target_arch
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["SPARSE_BLOCK_ROWS", "gather_rows", "sparse_mla", "sparse_mla_blocks", "sparse_mla_reference"]


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows (S, W) of any dtype (fp8 included, which has no CPU index kernel) at int64 ``index`` (any shape)
    -> (*index.shape, W).

    One ``index_select`` over the flattened index: a row copy per index, 3-4x faster on the CPU than advanced
    indexing ``rows[index]`` with a 2-D index (which goes through the generic TensorIterator index kernel).
    """
    flat = index.reshape(-1)
    if rows.dtype == FP8_DTYPE:
        return rows.view(torch.uint8).index_select(0, flat).view(FP8_DTYPE).view(*index.shape, rows.shape[-1])
    return rows.index_select(0, flat).view(*index.shape, rows.shape[-1])


def sparse_mla_reference(q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor, value_dim: int,
                         scale: float) -> torch.Tensor:
    """q (T, N, Dk), kv_rows (S, >= Dk), indices (T, K) -> (T, N, value_dim) in q.dtype."""
    dk = q.shape[-1]
    context = gather_rows(kv_rows, indices.clamp_min(0))[..., :dk].to(q.dtype)  # (T, K, Dk)
    scores = torch.matmul(q, context.transpose(1, 2))  # (T, N, K)
    scores = (scores.float() * scale).masked_fill((indices < 0)[:, None, :], float("-inf"))
    probs = scores.softmax(-1).to(context.dtype)
    return torch.matmul(probs, context[..., :value_dim])


# Selected rows the blockwise torch path gathers at once (queries x top-k): 2^16 rows of 576 float32 values = 144 MiB;
# the whole (T, K) gather of a 2K-token V3.2 prefill chunk at top-k 2048 would be 4M rows (4.5 GiB in bf16).
SPARSE_BLOCK_ROWS = 1 << 16


def sparse_mla_blocks(q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor, value_dim: int, scale: float,
                      block_rows: int = SPARSE_BLOCK_ROWS) -> torch.Tensor:
    """:func:`sparse_mla_reference` a tile of queries at a time, so at most ``block_rows`` selected rows (and their
    scores) are gathered at once; same arguments and result. Every query sees all its K rows in one softmax, so the
    values equal the reference's."""
    tile = max(1, block_rows // max(1, indices.shape[1]))
    if q.shape[0] <= tile:
        return sparse_mla_reference(q, kv_rows, indices, value_dim, scale)
    out = q.new_empty(q.shape[0], q.shape[1], value_dim)
    for lo in range(0, q.shape[0], tile):
        out[lo:lo + tile] = sparse_mla_reference(q[lo:lo + tile], kv_rows, indices[lo:lo + tile], value_dim, scale)
    return out


# Bound on the first kernel build (triton is imported lazily) and, for the codec, on every call of a builder
# (lazy_fp8_kernel); kernels look names up in module globals.
tl = triton = sum_combine = max_combine = attend_rows = e4m3_to_fp16 = fp32_to_e4m3 = None


@lazy_fp8_kernel
def attend_rows_fn():
    """The ``@triton.jit`` online-softmax step over one tile of latent rows, shared by this kernel and the paged
    decode kernel (:mod:`metainfer_gen.kernels.paged_mla_triton`)."""
    global tl, triton, sum_combine, max_combine  # kernels resolve names through module globals
    import triton
    import triton.language as tl

    # tl.max / tl.sum / tl.cdiv / tl.zeros are @triton.jit helpers the interpreter refuses to call when triton was
    # imported before TRITON_INTERPRET was set (see common._sum_combine): reduce with combine functions instead.
    sum_combine, max_combine = _sum_combine(tl), _max_combine(tl)

    @triton.jit
    def attend_rows(q_lat, q_pe, kv_ptr, slot, valid, m, denom, acc, R, P, stride_kv, scale,
                    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, SOFT_FP8: tl.constexpr):
        """(q_lat (H, BLOCK_R), q_pe (H, BLOCK_P)) in the dot dtype over the rows at ``slot`` (BLOCK_N,) where
        ``valid``; returns the updated running max (H,), sum (H,) and float32 accumulator (H, BLOCK_R). With
        ``SOFT_FP8`` the rows are uint8 e4m3 codes, decoded in software (no e4m3 conversion below sm_89)."""
        r = tl.arange(0, BLOCK_R)
        p = tl.arange(0, BLOCK_P)
        row = kv_ptr + slot[:, None] * stride_kv
        c = tl.load(row + r[None, :], mask=valid[:, None] & (r[None, :] < R), other=0.0)
        pe = tl.load(row + R + p[None, :], mask=valid[:, None] & (p[None, :] < P), other=0.0)
        if SOFT_FP8:
            c = e4m3_to_fp16(c)
            pe = e4m3_to_fp16(pe)
        c = c.to(q_lat.dtype)
        pe = pe.to(q_lat.dtype)
        # ieee: float32 dots (UPCAST) must match the float32 reference, not tf32's 10-bit mantissa; bf16 and
        # fp16 dots are unaffected by the precision argument.
        s = (tl.dot(q_lat, tl.trans(c), input_precision="ieee")
             + tl.dot(q_pe, tl.trans(pe), input_precision="ieee")) * scale  # (H, BLOCK_N) fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, max_combine))
        alpha = tl.exp(m - m_new)
        weights = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.reduce(weights, 1, sum_combine)
        acc = acc * alpha[:, None] + tl.dot(weights.to(q_lat.dtype), c, input_precision="ieee")
        return m_new, denom, acc

    return attend_rows


def _kernel():
    """The sparse MLA kernel for the current ``TRITON_INTERPRET`` setting, with the shared tile step (and its codec)
    bound in module globals on every call: an interpreted kernel looks them up each time it runs, and a compiled
    build in the same process (an AOT test) may have bound the other form last."""
    global attend_rows  # kernels resolve names through module globals
    attend_rows = attend_rows_fn()
    return _build_kernel()


@lazy_fp8_kernel
def _build_kernel():

    @triton.jit
    def sparse_mla_kernel(
        q_ptr,  # (T, N, R + P) contiguous absorbed queries
        kv_ptr,  # (S, row) cache rows (uint8 e4m3 codes when SOFT_FP8), unit stride in a row, row stride stride_kv
        idx_ptr,  # (T, K) int64 slots, -1 = padding
        out_ptr,  # (T, N, R) contiguous output, q dtype
        N,
        K,
        R,  # value / latent width (kv_lora_rank)
        P,  # rope width (qk_rope_head_dim)
        stride_kv,
        scale,
        UPCAST: tl.constexpr,  # dot in float32 (interpreter, fp32 and fp8 inputs); else the q dtype
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SOFT_FP8: tl.constexpr,  # fp8 rows decoded in software (no e4m3 conversion below sm_89, see fp8_codec)
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        r = tl.arange(0, BLOCK_R)
        p = tl.arange(0, BLOCK_P)
        dot_dtype = tl.float32 if UPCAST else q_ptr.dtype.element_ty
        q_base = q_ptr + t * N * (R + P) + h[:, None] * (R + P)
        q_lat = tl.load(q_base + r[None, :], mask=(h[:, None] < N) & (r[None, :] < R), other=0.0).to(dot_dtype)
        q_pe = tl.load(q_base + R + p[None, :], mask=(h[:, None] < N) & (p[None, :] < P), other=0.0).to(dot_dtype)
        m = tl.full((BLOCK_H,), -1.0e30, tl.float32)  # finite: an all-padding block must not give inf - inf
        denom = tl.full((BLOCK_H,), 0.0, tl.float32)
        acc = tl.full((BLOCK_H, BLOCK_R), 0.0, tl.float32)
        for start in range(0, K, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            slot = tl.load(idx_ptr + t * K + j, mask=j < K, other=-1)
            valid = slot >= 0
            m, denom, acc = attend_rows(q_lat, q_pe, kv_ptr, tl.maximum(slot, 0), valid, m, denom, acc, R, P,
                                        stride_kv, scale, BLOCK_R, BLOCK_P, SOFT_FP8)
        out = acc / denom[:, None]
        tl.store(out_ptr + t * N * R + h[:, None] * R + r[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(h[:, None] < N) & (r[None, :] < R))

    return sparse_mla_kernel


def sparse_mla_config(value_dim: int, rope_dim: int, upcast: bool, arch: int | None) -> dict:
    """Meta-parameters for a ``value_dim`` + ``rope_dim`` latent on sm_``arch`` (None: no GPU, the interpreter).

    DeepSeek-V3's 16 x 512 float32 accumulator, 16 x 512 queries and 32 x 512 latent rows on 4 warps needed 255
    registers and spilled 48-88 B (bf16) on every arch; 8 warps hold them in 166-198 registers, no spills. The
    float32 dots (``upcast``: float32 or fp8 inputs, IEEE) on 32 rows spilled 40-47 KB on 4 warps and needed 111 KB
    of shared memory, more than sm_89 and sm_120 have (100 KB per SM): 16 rows, 8 warps and one stage take 72 KB and
    126-128 registers without spills on all four archs (``benchmarks/triton_aot.py``). ``arch`` is kept in the
    signature so a later arch can differ; the choice is the same on sm_80, sm_89, sm_90 and sm_120.
    """
    meta = dict(BLOCK_H=16, BLOCK_R=pow2_at_least(value_dim), BLOCK_P=pow2_at_least(rope_dim),
                BLOCK_N=16 if upcast else 32, num_warps=8)
    if upcast:
        meta["num_stages"] = 1
    return meta


def sparse_mla_triton(q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor, value_dim: int,
                      scale: float, software: bool | None = None) -> torch.Tensor:
    """The Triton form of :func:`sparse_mla`; ``software`` forces the sm_80 decode of fp8 rows on or off (None: from
    the device, :func:`~metainfer_gen.kernels.fp8_codec.software_fp8`)."""
    tokens, heads, dk = q.shape
    soft = kv_rows.dtype == FP8_DTYPE and software_fp8(kv_rows.device, software)
    out = torch.empty(tokens, heads, value_dim, device=q.device, dtype=q.dtype)
    if tokens and indices.shape[1]:
        upcast = platform.triton_interpret_requested() or q.dtype == torch.float32 or kv_rows.dtype == FP8_DTYPE
        meta = sparse_mla_config(value_dim, dk - value_dim, upcast, target_arch(q.device))
        launch(_kernel(), (tokens, -(-heads // meta["BLOCK_H"])),
            q, fp8_bits(kv_rows, soft), indices, out, heads, indices.shape[1], value_dim, dk - value_dim,
            kv_rows.stride(0), float(scale), UPCAST=upcast, SOFT_FP8=soft, **meta)
    return out


def _triton_supports(q, kv_rows, indices, value_dim, scale) -> str | None:
    return first_refusal(
        triton_refusal(q, kv_rows, indices),
        dtype_refusal("q", q),
        contiguous_refusal("q", q), contiguous_refusal("indices", indices),
        None if kv_rows.stride(-1) == 1 else f"cache rows are strided (stride {tuple(kv_rows.stride())})",
        None if value_dim <= 1024 else f"kv_lora_rank {value_dim} over 1024: the accumulator would spill",
    )


def _example(device: str, dtype: torch.dtype):
    tokens, heads, slots = 256, 16, 32768  # a prefill chunk, 16 heads per rank, 32K cached tokens, top-k 2048
    q = torch.randn(tokens, heads, 576, device=device, dtype=dtype)
    rows = torch.randn(slots, 576, device=device, dtype=dtype)
    indices = torch.randint(0, slots, (tokens, 2048), device=device)
    return (q, rows, indices, 512, 192 ** -0.5), {}


SPARSE_MLA = register_op(Op("sparse_mla", "absorbed MLA over indexer-selected latent rows (prefill and decode)",
                            _example))
SPARSE_MLA.register("triton", sparse_mla_triton, _triton_supports,
                    description="one program per (token, 16 heads), online softmax over 32-row blocks")
SPARSE_MLA.register("torch-blocks", sparse_mla_blocks,
                    description=f"the reference a tile of queries at a time, at most {SPARSE_BLOCK_ROWS} rows gathered")
SPARSE_MLA.register("torch", sparse_mla_reference, description="gather the selected rows, masked softmax")


def sparse_mla(q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor, value_dim: int, scale: float, *,
               site: str | None = None, strict: bool | None = None) -> torch.Tensor:
    """Attention of each query over its selected latent-cache rows.

    Args:
        q: (T, N, r + dr) absorbed queries ``[q_nope @ W_UK, q_pe]``, float32/bfloat16/float16.
        kv_rows: (num_slots, row >= r + dr) cache rows ``[c_kv, k_pe, ...]`` (a flat view of the paged cache; extra
            columns such as the indexer key are ignored), any float dtype or float8_e4m3fn.
        indices: (T, K) int64 slots per query, ``-1`` for padding; every query needs at least one real slot.
        value_dim: r, the latent width (the value is ``c_kv``).
        scale: softmax scale.
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        (T, N, r) in q.dtype: ``softmax(q . rows) @ c_kv`` over the selected rows.
    Raises:
        ValueError: inconsistent shapes.
    Tolerance against :func:`sparse_mla_reference`: atol=rtol=1e-5 (float32).
    """
    if q.ndim != 3 or kv_rows.ndim != 2 or kv_rows.shape[1] < q.shape[2] or indices.ndim != 2 \
            or indices.shape[0] != q.shape[0] or not 0 < value_dim < q.shape[2]:
        raise ValueError(f"sparse_mla needs q (T, N, Dk), kv_rows (S, >= Dk), indices (T, K), 0 < value_dim < Dk; "
                         f"got {tuple(q.shape)}, {tuple(kv_rows.shape)}, {tuple(indices.shape)}, {value_dim}")
    return SPARSE_MLA.dispatch(q, kv_rows, indices.long(), value_dim, scale, site=site, strict=strict, stacklevel=2)
