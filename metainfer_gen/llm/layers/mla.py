"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent KV cache.

Per token the cache holds one row of ``kv_lora_rank + qk_rope_head_dim`` values: the normalised latent ``c_kv``
and the rotated shared key ``k_pe`` (DeepSeek-V2 paper, arXiv:2405.04434, section 2.1; 576 values for V3).
Two equivalent ways to attend (paper eq. 9-11 and its "absorb" remark; vLLM ``MLACommonImpl``):

- expanded: ``kv_b_proj`` turns the context's latents into per-head ``k_nope`` and ``v``, then ordinary causal
  attention. Numerically the closest to Hugging Face transformers' ``DeepseekV3Attention``.
- absorbed: ``q_nope`` is multiplied into ``W_UK`` (the key half of ``kv_b_proj``) so scores are taken against
  the latents directly, and ``W_UV`` is applied after the weighted sum. Per decode token this reads the 576-wide
  cache row once instead of expanding ``num_heads * (qk_nope + v)`` values per context token.

Decode always runs absorbed (:func:`metainfer_gen.kernels.paged_mla_decode`); a prefill row takes whichever form
costs fewer multiply-adds (:mod:`metainfer_gen.llm.layers.mla_prefill`). Both read the context a group of cache
blocks at a time with an online softmax, so no step holds scores or gathered rows for the whole context.

Module names mirror the Hugging Face checkpoint (``q_a_proj``, ``kv_a_proj_with_mqa``, ...) so weights load by
name. Shapes: T = new tokens in the step, N = heads, r = kv_lora_rank, dn/dr/dv = nope/rope/value head dims.

Tensor parallelism splits the heads: each rank holds N / size heads of ``q_b_proj`` / ``q_proj`` and ``kv_b_proj``
(column-parallel) and of ``o_proj`` (row-parallel, summed over the group); the latent projections, their norms
and the latent cache are replicated, as the cache row is shared by all heads (vLLM does the same). N must divide
by the size: no padded heads, so no rank computes a head that is thrown away.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer_gen import kernels
from metainfer_gen.llm import graph_ops
from metainfer_gen.kernels.gemm import bucketed_bmm
from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from metainfer_gen.llm.layers.mla_prefill import prefill_attention
from metainfer_gen.llm.layers.norm import RMSNorm
from metainfer_gen.llm.parallel import TensorParallel


class MLAttention(nn.Module):
    """MLA with a paged latent cache; ``config`` is a transformers ``DeepseekV3Config``.

    Raises:
        ValueError: ``num_attention_heads`` not divisible by the tensor-parallel size.
    """

    def __init__(self, config, layer_idx: int, softmax_scale: float, tp: TensorParallel | None = None):
        super().__init__()
        tp = tp or TensorParallel.single()
        self.layer_idx = layer_idx
        self.site = f"layers.{layer_idx}.self_attn"  # audit call-site name, built once (dispatch is per step)
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")  # heads on this rank
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.rope_interleave = bool(getattr(config, "rope_interleave", True))
        self.softmax_scale = softmax_scale
        hidden, bias = config.hidden_size, bool(config.attention_bias)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, config.num_attention_heads * self.qk_head_dim, tp=tp)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # eps 1e-6 as in transformers, not rms_norm_eps
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, config.num_attention_heads * self.qk_head_dim,
                                                 tp=tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, config.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim), tp=tp)
        self.kv_b_proj.fp8_eligible = False  # read as W_UK / W_UV by the absorbed path
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.v_head_dim, hidden, bias=bias, tp=tp)

    @property
    def cache_row_size(self) -> int:
        """Values per token in this layer's cache (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Leading values of a cache row that attention reads: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """x (T, hidden); cos/sin (T, dr/2) float32 tables at each token's position; kv_cache
        (num_blocks, block_size, 1, r + dr). Writes the new tokens' latents, returns (T, hidden)."""
        q_nope, q_pe, latent, _ = self._project(x, cos, sin)
        if meta.deferred:  # a compiled prefill step: one opaque op over the step's own metadata
            return self.o_proj(graph_ops.mla_store_attend(q_nope, q_pe, latent, kv_cache, self.layer_idx,
                                                          self.num_heads * self.v_head_dim))
        self._store(latent, kv_cache, meta)
        return self.o_proj(self.attend_dense(q_nope, q_pe, kv_cache.view(-1, self.cache_row_size), meta))

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_nope (T, N, dn), rotated q_pe (T, N, dr), latent row (T, 1, r + dr), q LoRA residual or None)."""
        num_tokens = x.shape[0]
        q_resid = None if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_resid is None else self.q_b_proj(q_resid)
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = kernels.rope(q_pe.contiguous(), cos, sin, interleaved=self.rope_interleave, site=self.site)
        k_pe = kernels.rope(k_pe.reshape(num_tokens, 1, -1).contiguous(), cos, sin,
                            interleaved=self.rope_interleave, site=self.site)
        return q_nope, q_pe, torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1), q_resid

    def _store(self, row: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        graph_ops.store_latent(row, kv_cache, meta.slot_mapping, self.site)

    def attend_dense(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache_rows: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """Every query over its whole causal context (eager; a compiled prefill step calls it from an opaque op,
        :func:`~metainfer_gen.llm.graph_ops.mla_store_attend`), a group of cache blocks at a time: decode rows
        absorbed in one batch (:func:`metainfer_gen.kernels.paged_mla_decode`), prefill rows one by one in the cheaper
        form (:func:`~metainfer_gen.llm.layers.mla_prefill.prefill_attention`);
        cache_rows (num_slots, row) -> (T, N * dv)."""
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        if meta.decode_rows:
            tokens = meta.decode_tokens
            query = self._absorb_query(q_nope[tokens], q_pe[tokens])  # (B, N, r + dr)
            latent = graph_ops.paged_mla_decode(query, cache_rows, meta.decode_block_tables, meta.decode_context_lens,
                                                meta.block_size, self.kv_lora_rank, self.softmax_scale, self.site)
            out[tokens] = self._unabsorb(latent)
        offsets = meta.query_offsets
        for row, slots in zip(meta.prefill_rows, meta.prefill_slots):
            lo, hi = offsets[row], offsets[row + 1]
            out[lo:hi] = prefill_attention(self, q_nope[lo:hi], q_pe[lo:hi], cache_rows, slots, meta.starts[row])
        return out.flatten(1)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (N, dn, r) and W_UV transposed (N, r, dv), each contiguous in the run dtype: laid out once from
        ``kv_b_proj.weight`` and kept until that weight changes (a new tensor or an in-place write). Under a
        compile the layout is traced instead (a frozen graph folds it into constants)."""
        weight = self.kv_b_proj.weight
        if torch.compiler.is_compiling():
            return self._layout(weight)
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        cached = self.__dict__.get("_absorbed")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_absorbed"] = (key, *self._layout(weight.detach()))
        return cached[1], cached[2]

    def _layout(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        return w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()

    def _absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """(B, N, dn), (B, N, dr) -> (B, N, r + dr): ``[q_nope @ W_UK, q_pe]`` scores a cache row
        ``[c_kv, k_pe]`` in one matmul (one head-batched GEMM, its rows bucketed on oneDNN)."""
        q_latent = bucketed_bmm(q_nope.transpose(0, 1), self._w_uk_uv()[0])  # (N, B, r)
        return torch.cat([q_latent.transpose(0, 1), q_pe], dim=-1)

    def _unabsorb(self, out_latent: torch.Tensor) -> torch.Tensor:
        """(B, N, r) attention output over latents -> (B, N, dv) through W_UV."""
        return bucketed_bmm(out_latent.transpose(0, 1), self._w_uk_uv()[1]).transpose(0, 1)
