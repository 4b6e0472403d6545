"""Tiny random DeepSeek-V3 checkpoints saved by transformers' own ``save_pretrained`` (the engine's reference)."""

from __future__ import annotations

import re

import torch

# Two shapes: MoE in all but the first layer (q LoRA, interleaved rope), and a mostly dense one without q LoRA
# and with half-split rope; both fp32, small enough to generate in milliseconds.
CONFIGS = {
    "moe": dict(vocab_size=160, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
                topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, rope_interleave=True),
    "dense_q_full": dict(vocab_size=160, hidden_size=48, intermediate_size=96, moe_intermediate_size=24,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=2,
                         n_routed_experts=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=12,
                         qk_nope_head_dim=12, n_group=1, topk_group=1, num_experts_per_tok=2,
                         first_k_dense_replace=2, rope_interleave=False),
}


def make_hf_model(name: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("deepseek_v3", max_position_embeddings=512, num_mtp_layers=0, bos_token_id=None,
                                  eos_token_id=None, **{**CONFIGS[name], **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    # Random routers with zero bias pick experts arbitrarily; a random bias exercises the biased choice too.
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def random_prompts(num: int, vocab: int, lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(num)]


def save_text_checkpoint(path, make_model=None):
    """A tiny random checkpoint with a real (BPE) tokenizer, for the pipeline, the CLI and the server; returns
    (model, tok). ``make_model(vocab_size)`` builds the transformers model (default: the "moe" DeepSeek-V3)."""
    from demo_models.llm.tokenizer import train_tokenizer

    texts = ["the quick brown fox jumps over the lazy dog", "the pass key is 12345. remember it."] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    model = (make_model or (lambda vocab: make_hf_model("moe", vocab_size=vocab)))(len(tokenizer))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


# DeepSeek's FP8 recipe: every linear, and (V3.2, GLM-5) the DSA indexer's wq_b / wk; not its weights_proj.
FP8_LINEAR = re.compile(r"(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj"
                        r"|indexer\.wq_b|indexer\.wk)\.weight$")


def save_fp8_checkpoint(model, path, max_shard_size: str | None = None) -> None:
    """Save ``model`` as DeepSeek ships FP8: every linear weight e4m3 + ``weight_scale_inv`` (128x128 blocks), the
    rest as is, config ``quantization_config`` fp8 [128, 128]; sharded (and indexed) when ``max_shard_size``."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from metainfer_gen.kernels import quantize_fp8_weight

    path = Path(path)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    index = path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(file)
        for name in [n for n in tensors if FP8_LINEAR.search(n)]:
            scale = name.removesuffix("weight") + "weight_scale_inv"
            tensors[name], tensors[scale] = quantize_fp8_weight(tensors[name])
            if weight_map is not None:
                weight_map[scale] = file.name
        save_file(tensors, file, metadata={"format": "pt"})
    if weight_map is not None:
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
