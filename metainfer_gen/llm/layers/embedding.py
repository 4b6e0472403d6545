"""Vocabulary-parallel token embedding and LM head (Megatron-LM ``VocabParallelEmbedding``; vLLM, nano-vllm
``layers/embed_head.py``).

Each rank holds ``ceil(vocab / size)`` rows of the table (the last rank's tail padded with zeros when the vocabulary
does not divide). The embedding looks up the ids that fall in its rows, zeros the others, and sums over the group
(one exact addition of a value and zeros). The head computes its slice of the logits and gathers the slices, cutting
the padding, so every rank holds the full (R, vocab) logits bit for bit alike and samples the same token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metainfer_gen.llm.parallel import Shard, TensorParallel, shard_range

__all__ = ["ParallelLMHead", "VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """ids (T,) int64 -> (T, hidden); the table is split by rows across the group."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp or TensorParallel.single()
        self.num_embeddings = num_embeddings
        self.start, self.end = shard_range(num_embeddings, self.tp)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, embedding_dim))
        self.weight.tp_shard = Shard(0, self.start, self.end - self.start, num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start).masked_fill(~local, 0), self.weight)
        out = out.masked_fill(~local[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """hidden (R, hidden) -> logits (R, vocab) float32; the weight is split by vocabulary rows. ``gemm``: the dense
    multiply, set at load by :func:`metainfer_gen.llm.layers.linear.configure_gemms`."""

    gemm = staticmethod(F.linear)

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp or TensorParallel.single()
        self.vocab_size = vocab_size
        start, end = shard_range(vocab_size, self.tp)
        self.weight = nn.Parameter(torch.empty(end - start, hidden_size))
        self.weight.tp_shard = Shard(0, start, end - start, vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.gemm(hidden, self.weight)
        if self.tp.enabled:
            logits = self.tp.all_gather_last(logits)[:, : self.vocab_size]
        return logits.float()
