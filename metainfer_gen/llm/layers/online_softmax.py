"""Attention over disjoint key blocks joined by log-sum-exp: the online softmax of FlashAttention and ring attention.

A block's partial result is its normalised output and its log-sum-exp per query; two partials over disjoint keys
merge exactly (FlashAttention, Dao et al. 2022, section 3.1; Ring Attention, arXiv:2310.01889), so a query never
needs all its scores at once. Used by the engine's blockwise MLA prefill (:mod:`metainfer_gen.llm.layers.mla_prefill`)
and by context-parallel prefill (:mod:`metainfer_gen.llm.context_parallel`).
"""

from __future__ import annotations

import torch

__all__ = ["LSEMerge", "block_attention", "flash_cpu", "softmax_parts"]


class LSEMerge:
    """Partial attention results over disjoint key sets merged by log-sum-exp: per query the normalised output so
    far and its log-sum-exp, float32.

    Args:
        shape: the leading dims of the queries (``(heads, queries)`` or ``(queries, heads)``).
        dv: value width.
        device: where the state lives.
    """

    def __init__(self, shape: tuple[int, ...], dv: int, device: torch.device | str = "cpu"):
        self.lse = torch.full(shape, float("-inf"), device=device)
        self.acc = torch.zeros(*shape, dv, device=device)

    def update(self, index, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge ``out`` (*shape[index], dv) and ``lse`` (*shape[index]), -inf where a query saw no key, into the
        queries ``index`` selects (a tuple of slices into ``shape``)."""
        old = self.lse[index]
        new = torch.logaddexp(old, lse)
        safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # -inf only when neither saw a key
        self.acc[index] = self.acc[index] * torch.exp(old - safe)[..., None] \
            + out.float() * torch.exp(lse - safe)[..., None]
        self.lse[index] = new

    def result(self) -> torch.Tensor:
        """(*shape, dv) float32; 0 for a query that saw no key."""
        return self.acc


def softmax_parts(scores: torch.Tensor, v: torch.Tensor, equation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (..., k) float32, -inf where masked -> (softmax(scores) applied to v by ``equation``, lse (...))."""
    lse = scores.logsumexp(-1)
    p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.einsum(equation, p, v.float()), lse


def flash_cpu(q, k, v, scale: float, mask: torch.Tensor | None, causal: bool = False):
    """PyTorch's fused CPU flash attention with its log-sum-exp (the kernel ``scaled_dot_product_attention``
    runs on the CPU), or None where it does not apply (another device or dtype, or no such op in this torch).
    q (N, t, dq), k (N, s, dq), v (N, s, dv), mask (t, s) bool or None, ``causal``: query i sees keys 0..i (the
    kernel's own mask, top-left aligned, no mask tensor) -> (out (N, t, dv), lse (N, t) float32)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        return None
    width = max(q.shape[-1], v.shape[-1])  # the kernel needs one head size: zero columns change nothing
    pad = lambda x: x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))  # noqa: E731
    bias = None if mask is None else torch.where(mask, 0.0, float("-inf")).to(q.dtype)
    out, lse = op(pad(q)[None], pad(k)[None], pad(v)[None], 0.0, causal,
                  attn_mask=None if bias is None else bias[None, None], scale=scale)
    return out[0, ..., : v.shape[-1]], lse[0].float()


def block_attention(q, k, v, scale: float, mask: torch.Tensor | None, fused: bool = True, causal: bool = False):
    """Attention of queries q (N, t, dq) over one block's keys k (N, s, dq) and values v (N, s, dv); mask (t, s)
    bool (True = visible) or None for all visible; ``causal`` (with mask None): query i sees keys 0..i. Returns
    (out (N, t, dv), lse (N, t) float32, -inf for a query that sees no key). ``fused`` uses :func:`flash_cpu` where
    it applies (about 5x faster than the unfused math on one CPU thread, same values to float32 rounding), else
    matmul + softmax."""
    parts = flash_cpu(q, k, v, scale, mask, causal) if fused else None
    if parts is None:
        if causal:
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = torch.einsum("ntd,nsd->nts", q, k).float() * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return softmax_parts(scores, v, "nts,nsd->ntd")
    out, lse = parts
    if mask is not None:  # the kernel reports lse 0 and output 0 for a fully masked query
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse
