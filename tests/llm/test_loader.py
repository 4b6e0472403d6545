"""Checkpoint formats the loader must accept: fused experts, FP8 block-scaled weights, MTP layers, tied heads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.kernels import fp8_weight_dequant
from tests.llm.checkpoints import hf_greedy, make_hf_model

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


def rewrite(path, transform):
    file = path / "model.safetensors"
    save_file(transform(load_file(file)), file, metadata={"format": "pt"})


def test_fused_expert_layout_loads(moe_checkpoint, tmp_path):
    model, src = moe_checkpoint
    model.save_pretrained(tmp_path)

    def fuse(state):
        out = {}
        for layer in range(1, model.config.num_hidden_layers):
            prefix = f"model.layers.{layer}.mlp.experts."
            n = model.config.n_routed_experts
            out[prefix + "gate_up_proj"] = torch.stack([torch.cat([state.pop(f"{prefix}{e}.gate_proj.weight"),
                                                                   state.pop(f"{prefix}{e}.up_proj.weight")])
                                                        for e in range(n)])
            out[prefix + "down_proj"] = torch.stack([state.pop(f"{prefix}{e}.down_proj.weight") for e in range(n)])
        return {**state, **out}

    rewrite(tmp_path, fuse)
    engine = LLMEngine.from_pretrained(tmp_path)
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == hf_greedy(model, PROMPT, 8)


def test_mtp_layers_are_skipped(moe_checkpoint, tmp_path):
    model, _ = moe_checkpoint
    model.save_pretrained(tmp_path)
    extra = model.config.num_hidden_layers
    rewrite(tmp_path, lambda s: {**s, f"model.layers.{extra}.eh_proj.weight": torch.randn(4, 4)})
    engine = LLMEngine.from_pretrained(tmp_path)
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == hf_greedy(model, PROMPT, 8)


def test_tied_embeddings(tmp_path):
    model = make_hf_model("moe", tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == hf_greedy(model, PROMPT, 8)


def test_fp8_dequant_keeps_partial_blocks():
    """200x300 weight: the last block row (72) and column (44) are partial and must keep their own scales."""
    torch.manual_seed(0)
    weight = torch.randn(200, 300).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3) + 0.5
    out = fp8_weight_dequant(weight, scale, torch.float32)
    expected = weight.float().clone()
    for i in range(2):
        for j in range(3):
            expected[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= scale[i, j]
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_fp8_checkpoint_loads_dequantised(moe_checkpoint, tmp_path):
    model, _ = moe_checkpoint
    model.save_pretrained(tmp_path)
    name = "model.layers.0.self_attn.kv_b_proj.weight"

    def quantise(state):
        w = state[name]
        scale = w.abs().amax().reshape(1, 1) / 448.0
        state[name] = (w / scale).to(torch.float8_e4m3fn)
        state[name.replace("weight", "weight_scale_inv")] = scale
        return state

    rewrite(tmp_path, quantise)
    engine = LLMEngine.from_pretrained(tmp_path)
    ours = engine.model.model.layers[0].self_attn.kv_b_proj.weight
    err = (ours - model.state_dict()[name]).abs().max() / model.state_dict()[name].abs().max()
    assert 0 < err < 0.07  # e4m3 keeps 3 mantissa bits


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not supported by the engine"):
        LLMEngine.from_pretrained(tmp_path, EngineConfig())
