"""Tiny random DeepSeek-V3.2 (``deepseek_v32``) checkpoints: the MoE shape of ``checkpoints.py`` plus an indexer."""

from __future__ import annotations

import torch

from tests.llm.checkpoints import CONFIGS

TOPK = 8
# Eight indexer heads: a key whose every head scores <= 0 ties at exactly 0 with probability 2**-8, so top-k
# boundaries rarely fall on a tie (a tie may break differently in a padded decode batch).
V32 = {k: v for k, v in CONFIGS["moe"].items() if k != "rope_interleave"} | dict(
    index_topk=TOPK, index_head_dim=16, index_n_heads=8)


def make_hf_v32_model(seed: int = 0, **overrides):
    """A transformers ``DeepseekV32ForCausalLM`` in float32 with random router bias and indexer LayerNorm."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("deepseek_v32", max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                                  **{**V32, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
            if name.endswith("indexer.k_norm"):
                module.weight.normal_(1, 0.2)
                module.bias.normal_(0, 0.2)
    return model
