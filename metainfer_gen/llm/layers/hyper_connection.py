"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams per token.

Each decoder block reads one collapsed input from the N streams (weights ``pre``), and writes its output back into
them (``post``), while the streams are mixed by ``comb``, a doubly-stochastic N x N matrix from a few Sinkhorn-Knopp
iterations, so the residual transform stays non-expansive. All three come from one small linear map of the
RMS-normalised, flattened streams, in float32. :class:`HyperHead` collapses the streams once more before the final
norm. Flat-token layout: streams are (T, N, hidden).

Source: DeepSeek-V4 paper section 2.2 (mHC, Xie et al. 2026); transformers 5.24 ``DeepseekV4HyperConnection`` and
``DeepseekV4HyperHead`` (the correctness reference; parameter names ``fn``, ``base``, ``scale``, ``hc_fn``, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, statistics in float32, result in ``x.dtype`` (V4's
    ``DeepseekV4UnweightedRMSNorm``)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """The mHC weights around one block (attention or MLP).

    Args:
        hc_mult: streams N. hidden_size: D. sinkhorn_iters: ``hc_sinkhorn_iters``. hc_eps, norm_eps: epsilons.
    Parameters (float32): ``fn`` ((2 + N) N, N D), ``base`` ((2 + N) N,), ``scale`` (3,).
    """

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        size = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.zeros(size, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.zeros(size))
        self.scale = nn.Parameter(torch.zeros(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (T, N, D) -> (post (T, N) float32, comb (T, N, N) float32, collapsed block input (T, D))."""
        n = self.hc_mult
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor
              ) -> torch.Tensor:
        """New streams (T, N, D): ``post`` spreads the block output (T, D) over the streams, plus ``comb``
        transposed times the old streams (stream k takes ``sum_j comb[j, k] streams[j]``)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1) + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """Final collapse of the N streams (T, N, D) -> (T, D) before the model's last norm.

    Parameters (float32): ``hc_fn`` (N, N D), ``hc_base`` (N,), ``hc_scale`` (1,).
    """

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.zeros(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
