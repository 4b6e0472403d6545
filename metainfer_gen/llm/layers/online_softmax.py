"""Attention over disjoint key blocks joined by log-sum-exp: the online softmax of FlashAttention and ring attention.

A block's partial result is its normalised output and its log-sum-exp per query; two partials over disjoint keys
merge exactly (FlashAttention, Dao et al. 2022, section 3.1; Ring Attention, arXiv:2310.01889), so a query never
needs all its scores at once. Used by the engine's blockwise MLA prefill (:mod:`metainfer_gen.llm.layers.mla_prefill`)
and by context-parallel prefill (:mod:`metainfer_gen.llm.context_parallel`).
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.block_attention import block_attention  # noqa: F401  (the blocks' inner step)

__all__ = ["LSEMerge", "block_attention", "softmax_parts"]


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
