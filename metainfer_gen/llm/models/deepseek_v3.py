"""DeepSeek-V3 and V3.2 for the engine: flat token batches, paged MLA latent cache, MoE after the first dense layers.

DeepSeek-V3.2 (``model_type`` ``deepseek_v32``) is the same network with sparse attention (an indexer per layer,
:class:`~metainfer_gen.llm.layers.sparse_mla.SparseMLAttention`); the attention class is looked up by model type.

Architecture and parameter names follow Hugging Face transformers ``modeling_deepseek_v3.py`` (the correctness
reference), so a checkpoint's safetensors load by name; the differences are the engine's: inputs are the
flattened new tokens of many sequences (T,) with explicit positions, attention reads the paged cache through
:class:`~metainfer_gen.llm.attention_metadata.AttentionMetadata`, and logits are computed only for the rows
the sampler needs. Multi-token-prediction layers in a checkpoint are not used.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from metainfer_gen.llm.layers.mla import MLAttention
from metainfer_gen.llm.layers.moe import MLP, MoE
from metainfer_gen.llm.layers.norm import RMSNorm
from metainfer_gen.llm.layers.sparse_mla import SparseMLAttention
from metainfer_gen.llm.parallel import TensorParallel

ATTENTION_BY_MODEL_TYPE = {"deepseek_v3": MLAttention, "deepseek_v32": SparseMLAttention}


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
        self.self_attn = ATTENTION_BY_MODEL_TYPE[config.model_type](config, layer_idx, scale, tp)
        types = getattr(config, "mlp_layer_types", None)  # V3.2 names each layer's MLP; V3 counts dense ones
        dense = (types[layer_idx] == "dense" if types else layer_idx < config.first_k_dense_replace) \
            or not config.n_routed_experts
        self.mlp = MLP(config.hidden_size, config.intermediate_size, tp) if dense else MoE(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    """Embedding, decoder layers, final norm (checkpoint prefix ``model.``)."""

    def __init__(self, config, max_positions: int, tp: TensorParallel):
        super().__init__()
        scale = softmax_scale(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, scale, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryTables(config, max_positions)

    def forward(self, input_ids, meta, kv_caches):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(meta.positions)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, cache)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Module):
    """The engine's DeepSeek-V3.

    Args:
        config: a transformers ``DeepseekV3Config`` or ``DeepseekV32Config`` (``model_type`` ``deepseek_v3`` or
            ``deepseek_v32``).
        max_positions: size of the rotary tables (the engine's ``max_model_len``).
        tp: tensor-parallel placement (None: one process). Every rank runs the same forward on the same tokens;
            each holds its heads, intermediate columns, experts and vocabulary rows, and the logits come out whole
            on every rank.
    Raises:
        ValueError: a dimension the tensor-parallel size does not divide (heads, intermediate sizes).
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
    def cache_row_size(self) -> int:
        """Cache values per token per layer: kv_lora_rank + qk_rope_head_dim (+ index_head_dim for V3.2)."""
        return self.model.layers[0].self_attn.cache_row_size

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids (T,) int64 -> hidden states (T, hidden); writes the new tokens into ``kv_caches``
        (one (num_blocks, block_size, 1, row) tensor per layer)."""
        return self.model(input_ids, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden) -> (R, vocab) float32 (whole on every rank under tensor parallelism)."""
        return self.lm_head(hidden)
