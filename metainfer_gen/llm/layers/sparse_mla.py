"""DeepSeek-V3.2 attention: MLA whose queries attend only to the tokens the lightning indexer selects (DSA).

Per token the layer's cache row is ``[c_kv (r), k_pe (dr), indexer key (D)]``: the indexer key cache lives beside
the latent, in the same pages. A step stores the new tokens' rows, then for every query (prefill and decode
alike, as FlashMLA's sparse kernels do) the indexer scores its visible context, keeps the top ``index_topk``
positions, the engine maps them to cache slots through the sequence's pages, and
:func:`metainfer_gen.kernels.sparse_mla` attends in the absorbed form over those rows only. When a query sees at
most ``index_topk`` tokens it selects all of them and the result is dense attention.

GLM-5 (``glm_moe_dsa``) is the same layer with two config-driven differences: the indexer's rope is interleaved,
and ``config.indexer_types`` marks "shared" layers, which have no indexer (no weights, no cached keys: their row
is the latent alone) and attend to the cache slots the previous "full" layer selected in the same forward
(:class:`TopKCarry`; transformers passes ``prev_topk_indices`` the same way; IndexCache, arXiv:2603.12201).

Sources: DeepSeek-V3.2-Exp paper (DSA, section 2.1) and ``inference/model.py``; transformers
``DeepseekV32Attention`` and ``GlmMoeDsaAttention`` (the correctness references); vLLM ``FlashMLASparseBackend``
for the paged form.
"""

from __future__ import annotations

import torch

from metainfer_gen import kernels
from metainfer_gen.kernels.audit_log import Refusal, record
from metainfer_gen.kernels.sparse_attention import gather_rows
from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.layers.indexer import Indexer
from metainfer_gen.llm.layers.mla import MLAttention
from metainfer_gen.llm.parallel import TensorParallel

# Page size of the public sparse-MLA kernels (FlashMLA sparse in vLLM/SGLang); ours gathers through flat slots.
SPARSE_KERNEL_PAGE = 64


class TopKCarry:
    """The cache slots the last "full" DSA layer of this forward selected, one (queries, k) int64 tensor per
    query group of :meth:`SparseMLAttention._groups` (-1 for padding), for the "shared" layers after it. One per
    model forward: every layer's cache has the same geometry and block tables, so a slot names the same token in
    every layer."""

    __slots__ = ("slot_ids",)

    def __init__(self) -> None:
        self.slot_ids: list[torch.Tensor] | None = None


class SparseMLAttention(MLAttention):
    """MLA + indexer; ``config`` is a transformers ``DeepseekV32Config`` or ``GlmMoeDsaConfig``.

    Args:
        indexer_rope_interleaved: the indexer's rope layout (GLM-5 interleaved, V3.2 half-split).
    Attributes:
        sparse: False attends densely over the same cache (the comparison the tests make); True by default.
        indexer: None on a "shared" layer (``config.indexer_types``), which reuses the previous layer's top-k.
    Raises:
        ValueError: no q LoRA (the indexer reads its residual), heads not divisible by the TP size, or an
            ``indexer_types`` entry other than "full" / "shared" (or "shared" on layer 0).
    """

    def __init__(self, config, layer_idx: int, softmax_scale: float, tp: TensorParallel | None = None,
                 indexer_rope_interleaved: bool = False):
        if config.q_lora_rank is None:
            raise ValueError("the DSA indexer reads the q LoRA residual: q_lora_rank must be set")
        super().__init__(config, layer_idx, softmax_scale, tp)
        kind = (getattr(config, "indexer_types", None) or ["full"] * (layer_idx + 1))[layer_idx]
        if kind not in ("full", "shared") or (kind == "shared" and layer_idx == 0):
            raise ValueError(f"indexer_types[{layer_idx}] is {kind!r}; expected 'full' or 'shared' (and layer 0 "
                             f"'full': a shared layer reuses the top-k of an earlier full one)")
        self.indexer = Indexer(config, layer_idx, indexer_rope_interleaved) if kind == "full" else None
        self.sparse = True

    @property
    def cache_row_size(self) -> int:
        """Values per token in this layer's cache: kv_lora_rank + qk_rope_head_dim (+ index_head_dim on a layer
        with its own indexer)."""
        return self.latent_size + (self.indexer.head_dim if self.indexer is not None else 0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, carry: TopKCarry | None = None) -> torch.Tensor:
        """x (T, hidden), cos/sin (T, dr/2), kv_cache (num_blocks, block_size, 1, row) -> (T, hidden). A full layer
        leaves its selection in ``carry``; a shared layer reads it from there.

        Raises:
            ValueError: a shared layer without a selection in ``carry`` (no full layer ran before it).
        """
        q_nope, q_pe, latent, q_resid = self._project(x, cos, sin)
        if self.indexer is not None:
            latent = torch.cat([latent, self.indexer.keys(x, cos, sin).unsqueeze(1).to(latent.dtype)], dim=-1)
        self._store(latent, kv_cache, meta)
        rows = kv_cache.view(-1, self.cache_row_size)
        if not self.sparse:
            return self.o_proj(self.attend_dense(q_nope, q_pe, rows, meta))
        self._audit_page_size(kv_cache.shape[1])
        selected = self._select(x, q_resid, cos, sin, rows, meta, carry)
        query = self._absorb_query(q_nope, q_pe)  # (T, N, r + dr)
        out = query.new_empty(x.shape[0], self.num_heads, self.kv_lora_rank)
        for (tokens, _, _), slot_ids in zip(self._groups(meta), selected):
            out[tokens] = kernels.sparse_mla(query[tokens], rows, slot_ids, self.kv_lora_rank,
                                             self.softmax_scale, site=f"layers.{self.layer_idx}.self_attn")
        return self.o_proj(self._unabsorb(out).flatten(1))

    def _select(self, x, q_resid, cos, sin, rows, meta, carry) -> list[torch.Tensor]:
        """Per query group, (queries, k) cache slots to attend to: this layer's indexer top-k, or the carried one."""
        if self.indexer is None:
            if carry is None or carry.slot_ids is None:
                raise ValueError(f"layer {self.layer_idx} shares the previous layer's top-k but no full indexer "
                                 f"layer ran before it in this forward")
            return carry.slot_ids
        iq, weights = self.indexer.queries(x, q_resid, cos, sin)
        selected = []
        for tokens, slots, lengths in self._groups(meta):
            keys = gather_rows(rows[:, self.latent_size:], slots)  # (B, L, D) as cached; scored in float32
            b, n = lengths.shape
            picked = self.indexer.select(iq[tokens].view(b, n, *iq.shape[1:]), weights[tokens].view(b, n, -1),
                                         keys, lengths)  # (B, n, k) positions in each row's context
            slot_ids = torch.where(picked >= 0, slots.gather(1, picked.clamp_min(0).flatten(1)).view_as(picked), -1)
            selected.append(slot_ids.flatten(0, 1))
        if carry is not None:
            carry.slot_ids = selected
        return selected

    @staticmethod
    def _groups(meta: AttentionMetadata):
        """(flat token indices, (B, L) context slots, (B, n) visible lengths) per batch of queries: all decode rows
        together (n = 1, contexts padded), then each prefill row (B = 1)."""
        if meta.decode_rows:
            yield meta.decode_tokens, meta.decode_slots(), meta.decode_context_lens[:, None]
        offsets = meta.query_offsets
        for row, slots in zip(meta.prefill_rows, meta.prefill_slots):
            lo, hi = offsets[row], offsets[row + 1]
            lengths = torch.arange(meta.starts[row] + 1, meta.starts[row] + 1 + hi - lo, device=slots.device)
            yield torch.arange(lo, hi, device=slots.device), slots[None], lengths[None]

    def _audit_page_size(self, page_size: int) -> None:
        if page_size != SPARSE_KERNEL_PAGE:
            record("sparse_mla_pages", f"layers.{self.layer_idx}.self_attn", "flat-slots",
                   (Refusal(f"paged-{SPARSE_KERNEL_PAGE}", f"page size {page_size}, sparse kernel needs "
                                                           f"{SPARSE_KERNEL_PAGE}: realigned (indexer positions "
                                                           f"mapped to flat cache slots)"),))
