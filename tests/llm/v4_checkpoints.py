"""Tiny random DeepSeek-V4 (``deepseek_v4``) models from transformers 5.24, for the V4 building blocks' tests."""

from __future__ import annotations

import torch

# Every layer type, both MLP router types, small compression rates so a short prompt closes many windows.
V4 = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=32,
          o_lora_rank=16, o_groups=2, hc_mult=2, index_topk=4, index_head_dim=16, index_n_heads=4,
          intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, sliding_window=16,
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          mlp_layer_types=["hash_moe", "moe", "moe"])


def make_hf_v4_model(seed: int = 0, **overrides):
    """A transformers ``DeepseekV4ForCausalLM`` in float32, every parameter drawn at random (position biases and
    norm weights included, so no term is a no-op)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("deepseek_v4", bos_token_id=None, eos_token_id=None, **{**V4, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("position_bias", "norm.weight", "sinks", "base", "scale")):
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
    return model


def compress_tables(config, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, rope_dim / 2) float32 cos/sin of the "compress" rope, from transformers' own rotary."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    cos, sin = DeepseekV4RotaryEmbedding(config)(torch.zeros(1), torch.arange(num_positions)[None], "compress")
    return cos[0].float(), sin[0].float()
