"""Attention of queries over one block of keys with its log-sum-exp: the inner step of blockwise (and ring) prefill.

The caller joins blocks by log-sum-exp (:class:`metainfer_gen.llm.layers.online_softmax.LSEMerge`). Four paths:

- ``bmm-fused`` (float32 on any CPU; bf16 on a CPU with native bf16): ``bmm-blocks`` with the softmax between its
  two GEMMs in one C++ pass per row (``csrc/block_softmax.cpp``: scale, mask, max, exp, sum in float32,
  probabilities written over the scores in their dtype), instead of eight torch passes and two casts over each
  block's scores. In float32 it is 1.2-1.9x PyTorch's fused flash kernel at MLA prefill shapes (8 heads, 512-1,024
  queries, 128-wide keys, 64-wide values; 2 Zen 3 cores): the flash kernel pads the values to the keys' width and
  computes more of the masked half (its blocks of 256 queries x 512 keys).
- ``bmm-blocks`` (float32 on any CPU; bf16/fp16 on a CPU with native bf16: AMX-BF16 or AVX512-BF16): a block of
  :data:`QUERY_BLOCK` queries at a time, the scores through ``bmm`` in the input dtype (oneDNN's bf16 GEMMs),
  a float32 softmax, the probabilities back in the input dtype through ``bmm`` with the values. A causal block of
  queries ``[lo, hi)`` reads keys ``[0, hi)`` only, so the masked half of the score matrix is never computed, and a
  block's float32 scores, ``(N, 128, s)``, stay in the cache. PyTorch's fused CPU flash kernel computes bf16 in
  vector code: on an AMD EPYC with AVX512-BF16 (one thread) this path ran 2.2-2.9x faster at MLA prefill shapes
  (8 heads, 256-1,024 queries over 640-768 keys), its error against float32 twice the kernel's (mean 4e-4 against
  2e-4 on unit-variance inputs: the scores are rounded to bf16 before the softmax).
- ``flash-cpu``: PyTorch's fused CPU flash attention (what ``scaled_dot_product_attention`` runs on the CPU), where
  bf16 is emulated. In float32 ``bmm-blocks`` (torch's softmax) is 1.04-1.31x it on 2 Zen 3 cores.
- ``torch`` (reference, any device): the whole (N, t, s) float32 score matrix through ``einsum``.
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.cpu_build import ensure_built, load_built
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["QUERY_BLOCK", "block_attention", "block_attention_reference"]

# Queries per block of the bmm path: 128 was the fastest of 64 / 128 / 256 at MLA prefill shapes (8 heads,
# 256-768 queries, one AVX512-BF16 thread); 256 was 1.7x slower causal (its float32 scores leave the cache).
# The prefill chunk size reads it (metainfer_gen.llm.attention_chunks.QUERY_BLOCK; a test checks they agree).
QUERY_BLOCK = 128


def _no_key(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_attention_reference(q, k, v, scale: float, mask: torch.Tensor | None = None, causal: bool = False):
    """The whole score matrix at once; same arguments and result as :func:`block_attention`."""
    if causal:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
    scores = torch.einsum("ntd,nsd->nts", q, k).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    p = torch.exp(scores - _no_key(lse)[..., None])
    return torch.einsum("nts,nsd->ntd", p, v.float()).to(q.dtype), lse


def _bmm_blocks(q, k, v, scale: float, mask: torch.Tensor | None = None, causal: bool = False,
                block: int = QUERY_BLOCK, fused: bool = False):
    kernel = ensure_built("block_softmax") if fused else None
    heads, t, s = q.shape[0], q.shape[1], k.shape[1]
    out = q.new_empty(heads, t, v.shape[-1])
    lse = torch.empty(heads, t, device=q.device)
    # oneDNN's bmm (bf16) copies any operand that is not one contiguous (N, rows, cols) block, so a block's key slice
    # is copied on every call: laid out transposed once, that copy is a plain one instead of a transposing one
    # (1.2-1.3x on this function at 512-1,024 causal queries, the same results bit for bit). MKL's float32 bmm takes
    # the transposed view as it is (1.2x over the laid-out keys, whose copy it also saves).
    relayout = t > block and q.dtype != torch.float32
    k_t = k.transpose(1, 2).contiguous() if relayout else k.transpose(1, 2)  # (N, dq, s)
    for lo in range(0, t, block):
        hi = min(t, lo + block)
        keys = min(s, hi) if causal else s  # causal, top-left aligned: query i sees keys 0..i
        scores = torch.bmm(q[:, lo:hi], k_t[:, :, :keys])  # (N, b, keys) in the input dtype
        rows = None if mask is None else mask[lo:hi]
        if kernel is not None:  # bf16 probabilities written over the scores
            top, total = (x[..., None] for x in kernel.block_softmax_(scores, scale, lo if causal else -1, rows))
            probs = scores
        else:
            probs, top, total = _softmax_rows(scores.float().mul_(scale), lo, rows, causal)
        out[:, lo:hi] = torch.bmm(probs.to(v.dtype), v[:, :keys]).div_(total.clamp_min(1e-30).to(v.dtype))
        lse[:, lo:hi] = (top + total.log())[..., 0]  # -inf where a query sees no key
    return out, lse


def _softmax_rows(scores: torch.Tensor, lo: int, mask: torch.Tensor | None, causal: bool):
    """float32 scores (N, b, keys) of queries lo.. -> (unnormalised probabilities in place, row max, row sum)."""
    keys = scores.shape[-1]
    if causal and keys > lo:
        diagonal = torch.ones(scores.shape[1], keys - lo, dtype=torch.bool, device=scores.device).triu_(1)
        scores[:, :, lo:keys].masked_fill_(diagonal, float("-inf"))
    elif mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    top = _no_key(scores.amax(-1, keepdim=True))
    probs = scores.sub_(top).exp_()
    return probs, top, probs.sum(-1, keepdim=True)


def _bmm_fused(q, k, v, scale: float, mask: torch.Tensor | None = None, causal: bool = False,
               block: int = QUERY_BLOCK):
    return _bmm_blocks(q, k, v, scale, mask, causal, block, fused=True)


def _bmm_fused_supports(q, k, v, scale, mask=None, causal=False) -> str | None:
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.bfloat16, torch.float32):
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: the fused softmax takes bfloat16 or float32 scores, one dtype"
    return _bmm_blocks_supports(q, k, v, scale, mask, causal) or load_built("block_softmax")[1]


def _bmm_blocks_supports(q, k, v, scale, mask=None, causal=False) -> str | None:
    from metainfer_gen.platform import capabilities

    if q.device.type != "cpu":
        return f"device {q.device.type}: the torch reference runs there (no fused GPU prefill kernel is built)"
    if q.dtype == torch.float32:  # MKL's float32 GEMMs: native on every CPU
        return None
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype}: the blocks run bfloat16, float16 or float32"
    if not capabilities().cpu_matrix:
        return f"{q.dtype} on a CPU without AMX-BF16 or AVX512-BF16: oneDNN would emulate its bf16 GEMMs"
    return None


def _flash_cpu(q, k, v, scale: float, mask: torch.Tensor | None = None, causal: bool = False):
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    width = max(q.shape[-1], v.shape[-1])  # the kernel needs one head size: zero columns change nothing
    pad = lambda x: x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))  # noqa: E731
    bias = None if mask is None else torch.where(mask, 0.0, float("-inf")).to(q.dtype)
    out, lse = op(pad(q)[None], pad(k)[None], pad(v)[None], 0.0, causal,
                  attn_mask=None if bias is None else bias[None, None], scale=scale)
    out, lse = out[0, ..., : v.shape[-1]], lse[0].float()
    if mask is not None:  # the kernel reports lse 0 and output 0 for a fully masked query
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse


def _flash_cpu_supports(q, k, v, scale, mask=None, causal=False) -> str | None:
    if getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None) is None:
        return "this torch has no _scaled_dot_product_flash_attention_for_cpu"
    if q.device.type != "cpu":
        return f"device {q.device.type}: a CPU kernel"
    if q.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {q.dtype} not in (float32, bfloat16)"
    return None


def _example(device: str, dtype: torch.dtype):
    heads, t, s = 8, 512, 512  # one MLA prefill chunk: 8 heads per rank, 512 new tokens
    q, k = (torch.randn(heads, n, 192, device=device, dtype=dtype) for n in (t, s))
    v = torch.randn(heads, s, 128, device=device, dtype=dtype)
    return (q, k, v, 192 ** -0.5), {"causal": True}


BLOCK_ATTENTION = register_op(Op("block_attention", "prefill attention over one block of keys, with its LSE",
                                 _example))
BLOCK_ATTENTION.register("bmm-fused", _bmm_fused, _bmm_fused_supports, devices=("cpu",),
                         description="bmm-blocks with its softmax in one C++ pass per row (float32, bf16)")
BLOCK_ATTENTION.register("bmm-blocks", _bmm_blocks, _bmm_blocks_supports, devices=("cpu",),
                         description="128 queries at a time, bmm (oneDNN bf16, MKL float32), causal half skipped")
BLOCK_ATTENTION.register("flash-cpu", _flash_cpu, _flash_cpu_supports, devices=("cpu",),
                         description="PyTorch's fused CPU flash attention")
BLOCK_ATTENTION.register("torch", block_attention_reference, description="the whole score matrix (einsum)")


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None, causal: bool = False, *, site: str | None = None,
                    strict: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries over one block of keys, with each query's log-sum-exp.

    Args:
        q: (N, t, dq) queries; k: (N, s, dq) keys; v: (N, s, dv) values; one float dtype (float32, bfloat16,
            float16).
        scale: softmax scale.
        mask: (t, s) bool, True = visible, or None (all visible).
        causal: with ``mask`` None, query i sees keys 0..i (top-left aligned, no mask tensor).
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        (out (N, t, dv) in q's dtype, lse (N, t) float32; -inf and an output of 0 for a query that sees no key).
    Raises:
        ValueError: inconsistent shapes, or both ``mask`` and ``causal``.
    Tolerance against :func:`block_attention_reference`: 1e-5 in float32; bf16 rounding of the scores and
    probabilities in bf16 (0.02 absolute on unit-variance inputs).
    """
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or len({q.shape[0], k.shape[0], v.shape[0]}) != 1 \
            or q.shape[2] != k.shape[2] or k.shape[1] != v.shape[1] \
            or (mask is not None and (causal or mask.shape != (q.shape[1], k.shape[1]))):
        raise ValueError(f"block_attention needs q (N, t, dq), k (N, s, dq), v (N, s, dv), mask (t, s) or causal, "
                         f"not both; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{None if mask is None else tuple(mask.shape)}, causal={causal}")
    return BLOCK_ATTENTION.dispatch(q, k, v, scale, mask, causal, site=site, strict=strict, stacklevel=2)
