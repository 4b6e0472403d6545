"""Tiny random DeepSeek-V3.2 (``deepseek_v32``) checkpoints: the MoE shape of ``checkpoints.py`` plus an indexer."""

from __future__ import annotations

import torch

from tests.llm.checkpoints import CONFIGS

TOPK = 8
# Eight indexer heads: a key whose every head scores <= 0 ties at exactly 0 with probability 2**-8, so top-k
# boundaries rarely fall on a tie (a tie may break differently in a padded decode batch).
V32 = {k: v for k, v in CONFIGS["moe"].items() if k != "rope_interleave"} | dict(
    index_topk=TOPK, index_head_dim=16, index_n_heads=8)


def make_hf_v32_model(seed: int = 0, model_type: str = "deepseek_v32", **overrides):
    """A transformers ``DeepseekV32ForCausalLM`` (or another DSA ``model_type``) in float32 with random router
    bias and indexer LayerNorm."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
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


# GLM-5 (``glm_moe_dsa``) differs from V3.2 only where its config says so: head widths (qk_nope != v, as GLM-5's
# 192 / 256), per-layer MLP types that are not a dense prefix, and "shared" indexer layers (no indexer weights).
GLM = {k: v for k, v in V32.items() if k != "first_k_dense_replace"} | dict(
    qk_nope_head_dim=12, v_head_dim=24, num_hidden_layers=4, indexer_types=["full", "shared", "shared", "full"],
    mlp_layer_types=["dense", "sparse", "dense", "sparse"])


def make_hf_glm_model(seed: int = 0, **overrides):
    """A transformers ``GlmMoeDsaForCausalLM`` in float32 with random router bias and indexer LayerNorm."""
    return make_hf_v32_model(seed, model_type="glm_moe_dsa", **{**GLM, **overrides})


def prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    """The engine model's logits (len(prompt), vocab) for one whole-prompt prefill on block size 4 pages."""
    from metainfer_gen.llm.attention_metadata import AttentionMetadata

    meta = AttentionMetadata.build([0], [len(prompt)], [list(range(len(prompt) // 4 + 1))], 4)
    with torch.inference_mode():
        return engine.model.compute_logits(engine.model(torch.tensor(prompt), meta, engine.runner.kv_caches))
