"""The engine against transformers on the same checkpoint: identical greedy tokens, prefill logits within 1e-4."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.attention_metadata import AttentionMetadata
from tests.llm.checkpoints import hf_greedy, random_prompts

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
LENGTHS = (1, 3, 7, 12, 16, 17, 29, 40)


@pytest.fixture(scope="module")
def references(hf_checkpoint):
    model, path = hf_checkpoint
    prompts = random_prompts(16, model.config.vocab_size, LENGTHS)
    return model, path, prompts, [hf_greedy(model, p, 32) for p in prompts]


def test_prefill_logits_match_transformers(hf_checkpoint):
    model, path = hf_checkpoint
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4))
    prompt = random_prompts(1, model.config.vocab_size, (37,))[0]
    blocks = list(range(10))
    meta = AttentionMetadata.build([0], [len(prompt)], [blocks], 4)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(prompt), meta, engine.runner.kv_caches)
        ours = engine.model.compute_logits(hidden)
        ref = model(torch.tensor([prompt])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_greedy_tokens_identical_16_prompts(references):
    model, path, prompts, expected = references
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4, max_num_batched_tokens=96))
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


def test_staggered_arrivals_continuous_batching(references):
    """Requests join while others decode: the batch mixes prefill chunks and decodes, tokens unchanged."""
    model, path, prompts, expected = references
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4, max_num_batched_tokens=24, max_num_seqs=5))
    pending = list(enumerate(prompts))
    ids, results, mixed_steps = {}, {}, 0
    while pending or engine.has_unfinished_requests:
        for _ in range(2):  # two arrivals per step
            if pending:
                i, p = pending.pop(0)
                ids[engine.add_request(p, GREEDY)] = i
        out = engine.scheduler.schedule()
        kinds = {item.num_tokens > 1 or not item.sample for item in out.scheduled}
        mixed_steps += len(kinds) == 2
        sampled = engine.runner.run(out)
        for seq in engine.scheduler.update(out, sampled):
            results[ids[seq.request_id]] = seq.output_token_ids
    assert [results[i] for i in range(len(prompts))] == expected
    assert mixed_steps > 0, "no step mixed prefill and decode work"


@pytest.mark.parametrize("budget", [5, 16])
def test_chunked_prefill_identical(references, budget):
    model, path, prompts, expected = references
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4, max_num_batched_tokens=budget))
    outputs = engine.generate(prompts[:6], GREEDY)
    assert [o.token_ids for o in outputs] == expected[:6]


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_block_sizes(references, block_size):
    model, path, prompts, expected = references
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=block_size))
    assert [o.token_ids for o in engine.generate(prompts[:5], GREEDY)] == expected[:5]


@pytest.mark.parametrize("length_offset", [-1, 0, 1])
def test_prefix_cache_cold_equals_warm(hf_checkpoint, length_offset):
    """Prompts of block_size-1, block_size, block_size+1 (and 3 blocks + offset) tokens: warm == cold == reference."""
    model, path = hf_checkpoint
    block = 8
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=block))
    for num_blocks in (1, 3):
        prompt = random_prompts(1, model.config.vocab_size, (num_blocks * block + length_offset,),
                                seed=7 + num_blocks)[0]
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        cold, warm = engine.generate([prompt], params)[0], engine.generate([prompt], params)[0]
        assert cold.token_ids == warm.token_ids == hf_greedy(model, prompt, 12)
        assert cold.num_cached_tokens == 0
        # Every full block before the last prompt token is reused; the last token is always computed.
        assert warm.num_cached_tokens == (len(prompt) - 1) // block * block


def test_shared_prefix_batch_reuses_blocks(hf_checkpoint):
    model, path = hf_checkpoint
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4))
    prefix = random_prompts(1, model.config.vocab_size, (24,), seed=3)[0]
    tails = random_prompts(4, model.config.vocab_size, (3, 5), seed=4)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate([prefix + [1]], params)  # warms the prefix
    outputs = engine.generate([prefix + t for t in tails], params)
    assert all(o.num_cached_tokens == 24 for o in outputs)
    assert [o.token_ids for o in outputs] == [hf_greedy(model, prefix + t, 8) for t in tails]


def test_preemption_keeps_tokens(references):
    """A KV pool too small for every running sequence forces recompute preemption; tokens stay identical."""
    model, path, prompts, expected = references
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4, num_kv_blocks=24, enable_prefix_caching=False))
    outputs = engine.generate(prompts[3:9], GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected[3:9]
    assert engine.block_manager.num_free_blocks == 24


def test_deepseek_head_dims_576_row(tmp_path):
    """DeepSeek-V3's real MLA widths (latent 512 + rope 64 = 576 per cache row, nope/v 128) on a tiny model."""
    from tests.llm.checkpoints import make_hf_model

    model = make_hf_model("moe", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                          num_attention_heads=2, num_key_value_heads=2)
    model.save_pretrained(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, EngineConfig(block_size=64))
    assert engine.runner.kv_caches[0].shape[-1] == 576
    prompts = random_prompts(3, model.config.vocab_size, (5, 70, 130))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [hf_greedy(model, p, 8) for p in prompts]
