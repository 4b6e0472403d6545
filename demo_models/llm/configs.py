"""Architecture of the embedded LLM: DeepSeek-V3 (MLA + MoE with a dense first layer), tiny."""

from __future__ import annotations

CONTEXT = 512  # trained context, tokens
VOCAB_SIZE = 512

MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=384,
    moe_intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=2048,
    num_mtp_layers=0,
    rope_interleave=True,
    tie_word_embeddings=False,
)
