"""DeepSeek Sparse Attention's lightning indexer: per-query scores over earlier keys, then the top-k per query.

For query token ``t`` and key ``s`` (DeepSeek-V3.2 paper, eq. 1; transformers ``DeepseekV32Indexer``)::

    I[t, s] = sum_h w[t, h] * relu(scale * q[t, h] . k[s])

where ``w`` already carries the ``n_heads ** -0.5`` factor. Keys past a query's visible length (the causal
limit) score ``-inf``. The top ``min(topk, L)`` keys are kept per query; when a query sees fewer keys than that,
the surplus entries are returned as ``-1`` (padding, never attended), so top-k >= length gives exactly dense
attention and short sequences never index out of range (the crash public indexers had below top-k).

Three paths, fastest first: the Triton kernel computes the scores (one program per query and block of keys, heads
reduced in registers) and ``torch.topk`` selects; the tiled torch path (:mod:`metainfer_gen.kernels.indexer_tiled`:
query x key tiles of bounded size, keys upcast per tile, top-k per query tile) runs wherever Triton does not; the
reference below materialises every per-head score and stays as the ground truth. All three compute the scores in
float32 in the same operation order, so they differ only in float32 rounding.
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.common import (_sum_combine, contiguous_refusal, first_refusal, pow2_at_least,
                                          triton_refusal)
from metainfer_gen.kernels.fp8_codec import fp8_bits, lazy_fp8_kernel, software_fp8
from metainfer_gen.kernels.fp8_quant import FP8_DTYPE
from metainfer_gen.kernels.indexer_tiled import indexer_topk_tiled
from metainfer_gen.kernels.launch import launch, target_arch
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["indexer_scores_reference", "indexer_topk", "indexer_topk_reference", "select_topk", "topk_overlap"]


def indexer_scores_reference(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """(B, n, H, D), (B, n, H), (B, L, D), (B, n) -> (B, n, L) float32 scores, ``-inf`` past each length.

    Operation order follows transformers (matmul, scale, relu, then the head-weighted sum) so the float32 values
    equal the reference model's and its top-k picks the same keys."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * scale  # (B, n, H, L)
    scores = torch.relu(scores)
    index = torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)  # (B, n, L)
    visible = torch.arange(keys.shape[1], device=keys.device) < lengths.unsqueeze(-1)
    return index.masked_fill(~visible, float("-inf"))


def select_topk(scores: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor:
    """(B, n, L) scores -> (B, n, min(topk, L)) int64 key indices, ``-1`` where a query sees fewer keys."""
    k = min(topk, scores.shape[-1])
    idx = scores.topk(k, dim=-1).indices
    return torch.where(idx < lengths.unsqueeze(-1), idx, torch.full_like(idx, -1))


def indexer_topk_reference(q, weights, keys, lengths, topk: int, scale: float) -> torch.Tensor:
    return select_topk(indexer_scores_reference(q, weights, keys, lengths, scale), lengths, topk)


def topk_overlap(picked: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of the reference's selected keys that ``picked`` also selected, over all queries.

    Both (..., k) int64 with ``-1`` padding (as :func:`indexer_topk` returns them); 1.0 when nothing was selected.
    """
    ref = reference.reshape(-1, reference.shape[-1])
    got = picked.reshape(-1, picked.shape[-1])
    if ref.numel() == 0 or got.numel() == 0:
        return 1.0 if int((ref >= 0).sum()) == 0 else 0.0
    width = int(max(ref.max(), got.max())) + 2  # column width + 1 catches the -1 padding
    chosen = torch.zeros(ref.shape[0], width, dtype=torch.bool, device=ref.device)
    chosen.scatter_(1, got.masked_fill(got < 0, width - 1), True)
    real = ref >= 0
    hits = chosen.gather(1, ref.masked_fill(~real, width - 1)) & real
    total = int(real.sum())
    return 1.0 if total == 0 else int(hits.sum()) / total


# Bound on the first kernel build (triton is imported lazily) and, for the codec, on every _kernel() call
# (lazy_fp8_kernel); kernels look names up in module globals.
tl = triton = sum_combine = e4m3_to_fp16 = fp32_to_e4m3 = None


@lazy_fp8_kernel
def _kernel():
    global tl, triton, sum_combine  # kernels resolve names through module globals (closures are not seen)
    import triton
    import triton.language as tl

    sum_combine = _sum_combine(tl)  # tl.sum fails in the interpreter when triton was imported first

    @triton.jit
    def indexer_scores_kernel(
        q_ptr,  # (B, n, H, D) contiguous queries
        w_ptr,  # (B, n, H) contiguous head weights
        k_ptr,  # (B, L, D) keys (uint8 e4m3 codes when SOFT_FP8), unit stride in a row, strides stride_kb, stride_kl
        len_ptr,  # (B, n) int64 visible keys per query
        out_ptr,  # (B, n, L) float32 scores
        n,
        H,
        D,
        L,
        stride_kb,
        stride_kl,
        scale,
        BLOCK_H: tl.constexpr,  # >= H and >= 16 (tl.dot)
        BLOCK_D: tl.constexpr,  # >= D and >= 16
        BLOCK_L: tl.constexpr,  # keys per program
        SOFT_FP8: tl.constexpr,  # fp8 keys decoded in software (no e4m3 conversion below sm_89, see fp8_codec)
    ):
        query = tl.program_id(0).to(tl.int64)  # flat (b, i)
        b = query // n
        keys = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + query * H * D + h[:, None] * D + d[None, :], mask=(h[:, None] < H) & (d[None, :] < D),
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * stride_kb + keys[:, None].to(tl.int64) * stride_kl + d[None, :],
                    mask=(keys[:, None] < L) & (d[None, :] < D), other=0.0)
        k = (e4m3_to_fp16(k) if SOFT_FP8 else k).to(tl.float32)
        w = tl.load(w_ptr + query * H + h, mask=h < H, other=0.0).to(tl.float32)
        # ieee: the reference is a float32 matmul, and tf32 (Triton's default) keeps 10 mantissa bits, enough to
        # reorder near-tied scores and so the top-k picks.
        s = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee") * scale, 0.0)  # (BLOCK_H, BLOCK_L)
        index = tl.reduce(s * w[:, None], 0, sum_combine)
        length = tl.load(len_ptr + query)
        index = tl.where(keys < length, index, float("-inf"))
        tl.store(out_ptr + query * L + keys, index, mask=keys < L)

    return indexer_scores_kernel


def indexer_config(heads: int, dim: int, arch: int | None) -> dict:
    """Meta-parameters for ``heads`` x ``dim`` queries on sm_``arch`` (None: no GPU, the interpreter).

    8 warps: the IEEE float32 dot of (64, 128) x (128, 32) held 216 registers on 4 warps (0 spills on sm_89/sm_90,
    13-16 KB of spills on sm_80/sm_120); 8 warps take 56-64 registers on sm_89/sm_90. sm_80 and sm_120 still
    spilled about 400 B at 32 keys per program, and none at 16 (``benchmarks/triton_aot.py``).
    """
    block_l = 16 if arch in (80, 86, 87, 120, 121) else 32
    return dict(BLOCK_H=pow2_at_least(heads), BLOCK_D=pow2_at_least(dim), BLOCK_L=block_l, num_warps=8)


def indexer_topk_triton(q, weights, keys, lengths, topk: int, scale: float,
                        software: bool | None = None) -> torch.Tensor:
    """The Triton form of :func:`indexer_topk`; ``software`` forces the sm_80 decode of fp8 keys on or off (None: from
    the device, :func:`~metainfer_gen.kernels.fp8_codec.software_fp8`)."""
    batch, n, heads, dim = q.shape
    length = keys.shape[1]
    soft = keys.dtype == FP8_DTYPE and software_fp8(keys.device, software)
    scores = torch.empty(batch, n, length, device=q.device, dtype=torch.float32)
    if batch * n and length:
        meta = indexer_config(heads, dim, target_arch(q.device))
        launch(_kernel(), (batch * n, -(-length // meta["BLOCK_L"])),
            q, weights, fp8_bits(keys, soft), lengths, scores, n, heads, dim, length, keys.stride(0), keys.stride(1),
            float(scale), SOFT_FP8=soft, **meta)
    return select_topk(scores, lengths, topk)


def _triton_supports(q, weights, keys, lengths, topk, scale) -> str | None:
    return first_refusal(
        triton_refusal(q, weights, keys, lengths),
        contiguous_refusal("q", q), contiguous_refusal("weights", weights), contiguous_refusal("lengths", lengths),
        None if keys.stride(-1) == 1 else f"key rows are strided (stride {tuple(keys.stride())})",
        None if q.shape[2] * q.shape[3] * 4 <= 65536 else "q row over 64 KB: one program holds all heads",
    )


def _example(device: str, dtype: torch.dtype):
    n, length = 256, 8192  # one 256-token prefill chunk at 8K context, V3.2 indexer shapes
    q = torch.randn(1, n, 64, 128, device=device, dtype=dtype)
    keys = torch.randn(1, length, 128, device=device, dtype=dtype)
    lengths = torch.arange(length - n + 1, length + 1, device=device)[None]
    return (q, torch.randn(1, n, 64, device=device), keys, lengths, 2048, 128 ** -0.5), {}


INDEXER_TOPK = register_op(Op("indexer_topk", "DSA lightning-indexer scores and per-query top-k", _example))
INDEXER_TOPK.register("triton", indexer_topk_triton, _triton_supports,
                      description="scores per (query, 32 keys) with all heads in one tl.dot; torch.topk")
INDEXER_TOPK.register("torch-tiled", indexer_topk_tiled,
                      description="float32 scores per query x key tile (keys upcast per tile), top-k per query tile")
INDEXER_TOPK.register("torch", indexer_topk_reference, description="matmul, relu, head-weighted sum, torch.topk")


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor, topk: int,
                 scale: float, *, site: str | None = None, strict: bool | None = None) -> torch.Tensor:
    """Top-k keys per query by the lightning indexer's score.

    Args:
        q: (B, n, H, D) indexer queries (rotated). weights: (B, n, H) per-head weights (times ``H ** -0.5``).
        keys: (B, L, D) indexer keys of each batch row's context (a padded gather for decode batches), as the cache
            holds them: float32/bfloat16/float16 or float8_e4m3fn (upcast to float32 for scoring on every path).
        lengths: (B, n) int64, keys visible to each query (``position + 1``); keys at index >= length are ignored.
        topk: keys kept per query (``index_topk``); clamped to L.
        scale: ``index_head_dim ** -0.5``.
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        (B, n, min(topk, L)) int64 indices into each row's keys, best first, ``-1`` for padding.
    Raises:
        ValueError: inconsistent shapes, or topk < 1.
    Tolerance: the paths pick the same keys unless two scores tie within float32 rounding (about 1e-6 relative);
    :func:`topk_overlap` measures how many they share.
    """
    if q.ndim != 4 or weights.shape != q.shape[:3] or keys.ndim != 3 or keys.shape[0] != q.shape[0] \
            or keys.shape[2] != q.shape[3] or lengths.shape != q.shape[:2]:
        raise ValueError(f"indexer shapes must be q (B, n, H, D), weights (B, n, H), keys (B, L, D), lengths (B, n); "
                         f"got {tuple(q.shape)}, {tuple(weights.shape)}, {tuple(keys.shape)}, {tuple(lengths.shape)}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1; got {topk!r}")
    return INDEXER_TOPK.dispatch(q, weights, keys, lengths.long(), topk, scale, site=site, strict=strict,
                                 stacklevel=2)
