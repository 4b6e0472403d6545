"""GLM-5 (``glm_moe_dsa``) in the engine against transformers' ``GlmMoeDsaForCausalLM`` on tiny random checkpoints:
the interleaved-rope indexer, "shared" layers reusing the previous layer's top-k, head widths and MLP layer types
read from the config; chunked prefill, prefix-cache hits, preemption, TP=2 and streamed sharded loading."""

from __future__ import annotations

import json

import pytest
import torch

from metainfer_gen import kernels
from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from tests.llm.checkpoints import hf_greedy, random_prompts
from tests.llm.dsa_checkpoints import GLM, TOPK, make_hf_glm_model, prefill_logits

MAX_NEW = 24
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
LENGTHS = (1, TOPK - 1, TOPK, TOPK + 1, 3 * TOPK, 5 * TOPK + 3)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    model = make_hf_glm_model()
    path = tmp_path_factory.mktemp("glm_moe_dsa")
    model.save_pretrained(path, max_shard_size="100KB")  # several shards: the streamed loader reads across them
    prompts = random_prompts(16, model.config.vocab_size, LENGTHS)
    return model, path, prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


def test_checkpoint_is_sharded_and_layers_follow_the_config(glm):
    model, path, _, _ = glm
    assert len(list(path.glob("*.safetensors"))) > 1
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4))
    layers = engine.model.model.layers
    r, dr, d = GLM["kv_lora_rank"], GLM["qk_rope_head_dim"], GLM["index_head_dim"]
    assert engine.model.cache_row_sizes == [r + dr + d, r + dr, r + dr, r + dr + d]
    assert [layer.self_attn.indexer is None for layer in layers] == [False, True, True, False]
    assert all(layer.self_attn.indexer.rope_interleaved for layer in layers if layer.self_attn.indexer)
    assert [hasattr(layer.mlp, "gate") for layer in layers] == [t == "sparse" for t in GLM["mlp_layer_types"]]
    assert layers[0].self_attn.v_head_dim == 24 and layers[0].self_attn.qk_nope_head_dim == 12
    assert [c.shape[-1] for c in engine.runner.kv_caches] == engine.model.cache_row_sizes


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_greedy_tokens_and_logits_equal_transformers(glm, block_size):
    """Pages of 1, 16 and 64 tokens (64: the sparse kernels' page, no realignment refusal)."""
    model, path, prompts, expected = glm
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=block_size, max_num_batched_tokens=96))
    long = random_prompts(1, model.config.vocab_size, (5 * TOPK,), seed=5)[0]
    with torch.inference_mode():
        torch.testing.assert_close(prefill_logits(engine, long), model(torch.tensor([long])).logits[0], atol=1e-4,
                                   rtol=0)
    with kernels.audit() as report:
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert {"sparse_mla", "indexer_topk"} <= set(report.paths())
    assert bool(report.refusals().get("sparse_mla_pages")) == (block_size != 64)
    assert report.paths()["llm_attention"].keys() == {
        "glm_moe_dsa: MLA + DSA: indexer (interleaved rope) on indexer_types 'full' layers, 'shared' layers reuse "
        "the previous full layer's top-k; absorbed sparse MLA (2 of 4 layers share top-k)"}


def test_config_differences_matter_past_topk(glm):
    """Half-split indexer rope (V3.2's) or a shared layer running dense changes the logits once a query sees more
    than top-k tokens: the config-driven paths are exercised, not bypassed."""
    model, path, _, _ = glm
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4))
    prompt = random_prompts(1, model.config.vocab_size, (5 * TOPK,), seed=6)[0]
    reference = prefill_logits(engine, prompt)
    layers = engine.model.model.layers
    for layer in layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.rope_interleaved = False
    assert (prefill_logits(engine, prompt)[TOPK:] - reference[TOPK:]).abs().max() > 1e-3
    for layer in layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.rope_interleaved = True
    torch.testing.assert_close(prefill_logits(engine, prompt), reference, atol=1e-6, rtol=0)
    layers[1].self_attn.sparse = False
    assert (prefill_logits(engine, prompt)[TOPK:] - reference[TOPK:]).abs().max() > 1e-3


def test_chunked_prefill_with_chunk_ends_inside_blocks(glm):
    """5-token chunks on 8-token pages: chunk ends fall inside pages and inside top-k windows."""
    _, path, prompts, expected = glm
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=8, max_num_batched_tokens=5, max_num_seqs=4))
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected


def test_prefix_cache_hits_keep_tokens(glm):
    model, path, _, _ = glm
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4))
    prefix = random_prompts(1, model.config.vocab_size, (3 * TOPK,), seed=3)[0]
    tails = random_prompts(4, model.config.vocab_size, (3, 5), seed=4)
    engine.generate([prefix + [1]], GREEDY)  # warms the prefix
    outputs = engine.generate([prefix + t for t in tails], GREEDY)
    assert all(o.num_cached_tokens == len(prefix) for o in outputs)
    assert [o.token_ids for o in outputs] == [hf_greedy(model, prefix + t, MAX_NEW) for t in tails]


def test_batch_of_16_with_preemption_keeps_tokens(glm):
    model, path, prompts, expected = glm
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4, num_kv_blocks=40, max_num_seqs=16))
    outputs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected


def test_kv_bytes_per_block_equal_the_planner_formula(glm):
    from metainfer_gen.llm.model_runner import kv_cache_bytes_per_block
    from metainfer_gen.llm.plan_model import ModelDims, kv_bytes_per_token

    _, path, _, _ = glm
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=16))
    dims = ModelDims.from_config(json.loads((path / "config.json").read_text()))
    assert dims.num_indexer_layers == 2
    per_token = kv_bytes_per_token(dims, "fp32")["total"]
    assert kv_cache_bytes_per_block(engine.model, 16, torch.float32) == per_token * 16
    assert engine.kv_sizing.bytes_per_block == per_token * 16


def test_tp2_streamed_sharded_load_equals_transformers(glm, tmp_path):
    from tests.collectives.harness import run_ranks

    model, path, prompts, expected = glm
    logit_prompt = random_prompts(1, model.config.vocab_size, (37,), seed=5)[0]
    with torch.inference_mode():
        ref_logits = model(torch.tensor([logit_prompt])).logits[0]
    results = run_ranks("tests.llm.tp_workers:greedy_tp", tmp_path, timeout_s=300, path=str(path),
                        prompts=prompts[:8], logit_prompt=logit_prompt, max_new_tokens=MAX_NEW)
    for rank, out in results.items():
        assert out["tokens"] == expected[:8], f"rank {rank}"
        torch.testing.assert_close(torch.tensor(out["logits"]), ref_logits, atol=1e-4, rtol=0)
        assert out["local_heads"] == model.config.num_attention_heads // 2


def test_deepseek_format_fp8_checkpoint_loads_dequantised_to_transformers_tokens(tmp_path):
    """GLM-5 ships FP8 (e4m3 + 128x128 ``weight_scale_inv``, the indexer's wq_b / wk included, weights_proj not): a
    checkpoint of weights already on the FP8 grid, saved in that format, loads dequantised on the CPU to exactly
    those weights, so its greedy tokens equal transformers' on the same grid weights (a shared layer has no indexer
    weights to quantise)."""
    from metainfer_gen.kernels.fp8_quant import dequantize_fp8_weight_reference, quantize_fp8_weight
    from metainfer_gen.llm.checkpoint import SafetensorsCheckpoint
    from tests.llm.checkpoints import FP8_LINEAR, save_fp8_checkpoint

    def to_grid(weight):
        return dequantize_fp8_weight_reference(*quantize_fp8_weight(weight))

    model = make_hf_glm_model(seed=2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if FP8_LINEAR.search(name):
                param.copy_(to_grid(param.data))
            elif name.endswith("experts.gate_up_proj"):  # saved per expert as gate_proj / up_proj: one grid each
                for expert in param:
                    gate, up = expert.chunk(2)
                    expert.copy_(torch.cat([to_grid(gate), to_grid(up)]))
            elif name.endswith("experts.down_proj"):
                for expert in param:
                    expert.copy_(to_grid(expert))
    save_fp8_checkpoint(model, tmp_path, max_shard_size="100KB")
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert {ckpt.dtype(f"model.layers.0.self_attn.indexer.{n}.weight") for n in ("wq_b", "wk")} == {"F8_E4M3"}
        assert ckpt.dtype("model.layers.0.self_attn.indexer.weights_proj.weight") == "F32"
    engine = LLMEngine.from_pretrained(tmp_path, EngineConfig(block_size=4))
    assert engine.weight_format.name.startswith("dequantised from fp8")
    prompts = random_prompts(4, model.config.vocab_size, (TOPK + 1, 3 * TOPK), seed=8)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [hf_greedy(model, p, MAX_NEW) for p in prompts]
