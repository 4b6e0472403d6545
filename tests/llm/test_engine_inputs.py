"""Bad requests get clear errors before any work; refused requests do not stop the others; no KV leaks."""

from __future__ import annotations

import pytest

from metainfer_gen.llm import EngineConfig, LLMEngine, RequestRejected, SamplingParams
from tests.llm.checkpoints import random_prompts

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(moe_checkpoint):
    _, path = moe_checkpoint
    return LLMEngine.from_pretrained(path, EngineConfig(block_size=4, max_model_len=64, num_kv_blocks=12))


def test_prompt_longer_than_context_is_refused_per_request(engine):
    prompts = [[5] * 80, [6, 7, 8]]
    outputs = engine.generate(prompts, GREEDY)
    assert outputs[0].finish_reason == "error" and "max_model_len=64" in outputs[0].error
    assert outputs[1].finish_reason == "length" and len(outputs[1].token_ids) == 4
    with pytest.raises(RequestRejected, match="max_model_len=64"):
        engine.add_request([5] * 64, GREEDY)


def test_request_larger_than_kv_pool_is_refused(engine):
    # 12 blocks x 4 = 48 tokens of KV; 40 + 20 cannot ever fit.
    outputs = engine.generate([[3] * 40, [4] * 5], SamplingParams(max_new_tokens=20, temperature=0))
    assert outputs[0].finish_reason == "error" and "48" in outputs[0].error and "max_new_tokens" in outputs[0].error
    assert outputs[1].finish_reason == "length"


@pytest.mark.parametrize("prompt, match", [([], "empty prompt"), ([1, 999], r"\[0, 160\)"), ([-1], r"\[0, 160\)")])
def test_malformed_prompt_raises_before_work(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match=match):
        engine.generate([[1, 2], prompt], GREEDY)
    assert not engine.has_unfinished_requests  # nothing was queued


def test_text_prompt_without_tokenizer(engine):
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("hello", GREEDY)


def test_no_blocks_leak_after_mixed_runs(engine):
    prompts = random_prompts(10, 160, (2, 9, 17, 30))
    engine.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0.8, seed=n) for n in range(1, 11)])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine._requests


def test_abort_frees_blocks(engine):
    rid = engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=20, temperature=0))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort(rid)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests


def test_streaming_yields_each_token(engine):
    deltas = list(engine.stream([[1, 2, 3]], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)))
    assert [len(d.new_token_ids) for d in deltas] == [1] * 5
    assert deltas[-1].finished and deltas[-1].token_ids == [d.new_token_ids[0] for d in deltas]
    assert deltas[0].ttft is not None and deltas[-1].mean_token_latency is not None


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"), (dict(dtype="float8"), "dtype"),
    (dict(kv_cache_memory_gib=0), "kv_cache_memory_gib"),
])
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_unchunked_budget_must_cover_context(moe_checkpoint):
    _, path = moe_checkpoint
    with pytest.raises(ValueError, match="chunked prefill off"):
        LLMEngine.from_pretrained(path, EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=32,
                                                     max_model_len=64))


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLMEngine.from_pretrained(tmp_path)
