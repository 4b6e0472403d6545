"""DeepSeek-V3.2's lightning indexer (DSA): which earlier tokens each query attends to.

Parameters as transformers' ``DeepseekV32Indexer`` names them: ``wq_b`` (q_lora_rank -> H * D, reading MLA's
normalised q LoRA residual), ``wk`` (hidden -> D) followed by the LayerNorm ``k_norm``, and ``weights_proj``
(hidden -> H, kept in float32). The first ``qk_rope_head_dim`` values of each query and key are rotated with
half-split (non-interleaved) rope in DeepSeek-V3.2, unlike MLA's interleaved rope, and with interleaved rope in
GLM-5 (transformers ``GlmMoeDsaIndexer``; the family table says which, ``models/families.py``). The reference
implementation's Hadamard rotation (which leaves the dot products unchanged) and its fp8 scoring (a speed for precision
trade, measured in ``benchmarks/sparse_mla.py``) are not applied, as in transformers. Scoring and top-k:
:func:`metainfer_gen.kernels.indexer_topk`, which reads the keys in the cache's dtype (bf16 in a bf16 run, e4m3 in an
fp8 KV cache) and accumulates the scores in float32.

The key of every token is stored in the layer's cache row beside the latent (see
:class:`~metainfer_gen.llm.layers.sparse_mla.SparseMLAttention`), so it shares the block table, prefix cache and
preemption of the latent cache without extra bookkeeping.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer_gen import kernels
from metainfer_gen.llm.layers.linear import ReplicatedLinear


class Indexer(nn.Module):
    """Indexer of one layer; ``config`` is a transformers ``DeepseekV32Config`` or ``GlmMoeDsaConfig``.

    Shapes: T tokens, H = ``index_n_heads``, D = ``index_head_dim``, dr = ``qk_rope_head_dim`` (< D).
    ``rope_interleaved``: rotate the rope dims in interleaved pairs (GLM-5) instead of half-split (V3.2).
    """

    def __init__(self, config, layer_idx: int, rope_interleaved: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.rope_interleaved = rope_interleaved
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.softmax_scale = self.head_dim ** -0.5
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads)
        self.weights_proj.fp8_eligible = False  # float32 in transformers (_keep_in_fp32_modules)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        rot = kernels.rope(rot.contiguous(), cos, sin, interleaved=self.rope_interleaved,
                           site=f"layers.{self.layer_idx}.indexer")
        return torch.cat([rot, rest], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), cos/sin (T, dr/2) -> rotated keys (T, D) in x.dtype, to be cached."""
        k = self.k_norm(self.wk(x)).unsqueeze(1)  # (T, 1, D)
        return self._rotate(k, cos, sin).squeeze(1)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated queries (T, H, D), head weights (T, H) float32 times ``H ** -0.5``)."""
        q = self.wq_b(q_resid).view(x.shape[0], self.num_heads, self.head_dim)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.num_heads ** -0.5
        return self._rotate(q, cos, sin), weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               lengths: torch.Tensor) -> torch.Tensor:
        """Top-k key indices: q (B, n, H, D), weights (B, n, H), keys (B, L, D), lengths (B, n) ->
        (B, n, min(topk, L)) int64, -1 for padding."""
        return kernels.indexer_topk(q, weights, keys, lengths, self.topk, self.softmax_scale,
                                    site=f"layers.{self.layer_idx}.indexer")
