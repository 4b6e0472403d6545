"""DeepSeek-V3, V3.2 and GLM-5 for the engine: flat token batches, paged MLA latent cache, MoE after dense layers.

DeepSeek-V3.2 (``model_type`` ``deepseek_v32``) is the same network with sparse attention (an indexer per layer,
:class:`~metainfer_gen.llm.layers.sparse_mla.SparseMLAttention`); GLM-5 (``glm_moe_dsa``) is V3.2 with an
interleaved-rope indexer and "shared" layers that reuse the previous layer's top-k (``indexer_types``), its head
widths and per-layer MLP types read from the config. The family table (:mod:`~metainfer_gen.llm.models.families`)
says which attention each model type runs.

Architecture and parameter names follow Hugging Face transformers ``modeling_deepseek_v3.py`` (the correctness
reference), so a checkpoint's safetensors load by name; the differences are the engine's: inputs are the
flattened new tokens of many sequences (T,) with explicit positions, attention reads the paged cache through
:class:`~metainfer_gen.llm.attention_metadata.AttentionMetadata`, and logits are computed only for the rows
the sampler needs. Multi-token-prediction layers in a checkpoint are not used.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer_gen.kernels.audit_log import record
from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from metainfer_gen.llm.layers.mla import MLAttention
from metainfer_gen.llm.layers.moe import MLP, MoE
from metainfer_gen.llm.layers.norm import RMSNorm
from metainfer_gen.llm.layers.sparse_mla import SparseMLAttention, TopKCarry
from metainfer_gen.llm.models.families import AUDIT_OP, AUDIT_SITE, attention_path, family_of
from metainfer_gen.llm.parallel import TensorParallel


def softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's mscale squared when the rope is scaled with ``mscale_all_dim``
    (transformers ``yarn_apply_mscale``; DeepSeek-V3's ``softmax_scale``)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    return yarn_apply_mscale(config.rope_parameters, (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)


class RotaryTables(nn.Module):
    """cos/sin tables per position, (positions, qk_rope_head_dim / 2) float32, from transformers' rotary
    embedding (so every ``rope_type`` it knows, YaRN included, is computed as the reference computes it)."""

    def __init__(self, config, max_positions: int):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

        rotary = DeepseekV3RotaryEmbedding(config)
        positions = torch.arange(max_positions)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
        half = cos.shape[-1] // 2
        self.register_buffer("cos", cos[0, :, :half].contiguous(), persistent=False)
        self.register_buffer("sin", sin[0, :, :half].contiguous(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, scale: float, tp: TensorParallel):
        super().__init__()
        family = family_of(config.model_type)
        self.sparse = family.sparse
        self.self_attn = SparseMLAttention(config, layer_idx, scale, tp, family.indexer_rope_interleaved) \
            if family.sparse else MLAttention(config, layer_idx, scale, tp)
        types = getattr(config, "mlp_layer_types", None)  # V3.2 / GLM-5 name each layer's MLP; V3 counts dense ones
        dense = (types[layer_idx] == "dense" if types else layer_idx < config.first_k_dense_replace) \
            or not config.n_routed_experts
        self.mlp = MLP(config.hidden_size, config.intermediate_size, tp) if dense else MoE(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv_cache, carry: TopKCarry | None = None):
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, cos, sin, meta, kv_cache, carry) if self.sparse
                 else self.self_attn(h, cos, sin, meta, kv_cache))
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, opaque=True) if meta.deferred and isinstance(self.mlp, MoE) else self.mlp(h))


class DeepseekV3Model(nn.Module):
    """Embedding, decoder layers, final norm (checkpoint prefix ``model.``)."""

    def __init__(self, config, max_positions: int, tp: TensorParallel):
        super().__init__()
        scale = softmax_scale(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, scale, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTables(config, max_positions)
        self.attention_path = attention_path(config)

    def forward(self, input_ids, meta, kv_caches):
        if not torch.compiler.is_compiling():  # eager steps (every prefill) audit; a compiled decode graph does not
            record(AUDIT_OP, AUDIT_SITE, self.attention_path)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(meta.positions)
        # a full DSA layer's selection, for the shared layers after it (GLM-5); dense models (the compiled ones)
        # build nothing
        carry = TopKCarry() if self.layers[0].sparse else None
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, cache, carry)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Module):
    """The engine's DeepSeek-V3 / V3.2 / GLM-5.

    Args:
        config: a transformers ``DeepseekV3Config``, ``DeepseekV32Config`` or ``GlmMoeDsaConfig`` (``model_type``
            ``deepseek_v3``, ``deepseek_v32`` or ``glm_moe_dsa``).
        max_positions: size of the rotary tables (the engine's ``max_model_len``).
        tp: tensor-parallel placement (None: one process). Every rank runs the same forward on the same tokens;
            each holds its heads, intermediate columns, experts and vocabulary rows, and the logits come out whole
            on every rank.
    Raises:
        ValueError: a dimension the tensor-parallel size does not divide (heads, intermediate sizes), or a model
            type the engine cannot run (:func:`~metainfer_gen.llm.models.families.family_of`).
    """

    def __init__(self, config, max_positions: int, tp: TensorParallel | None = None):
        super().__init__()
        tp = tp or TensorParallel.single()
        self.config = config
        self.tp = tp
        self.model = DeepseekV3Model(config, max_positions, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def cache_row_sizes(self) -> list[int]:
        """Cache values per token of each layer: kv_lora_rank + qk_rope_head_dim, + index_head_dim on a layer with
        its own DSA indexer (every V3.2 layer; GLM-5's "full" layers)."""
        return [layer.self_attn.cache_row_size for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids (T,) int64 -> hidden states (T, hidden); writes the new tokens into ``kv_caches``
        (one (num_blocks, block_size, 1, cache_row_sizes[i]) tensor per layer)."""
        return self.model(input_ids, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden) -> (R, vocab) float32 (whole on every rank under tensor parallelism)."""
        return self.lm_head(hidden)
