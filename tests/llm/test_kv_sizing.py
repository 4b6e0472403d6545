"""KV pool sized from the measured worst step (the largest prefill chunk and the largest decode batch, both at the
longest context): the planner predicts the measurement, refusals carry the numbers, and a 256-request mixed load
stays inside the memory the sizing reserved and frees every block."""

from __future__ import annotations

import random

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, RequestRejected, SamplingParams
from metainfer_gen.llm.memory_profile import StorageTracker, measure_prefill_peak, tensor_bytes
from metainfer_gen.llm.plan_activations import worst_step_activation_bytes
from metainfer_gen.llm.plan_model import ModelDims, kv_bytes_per_token

MIB = 2**20


def _engine(path, **kw):
    return LLMEngine.from_pretrained(path, EngineConfig(block_size=16, max_model_len=512, max_num_seqs=16,
                                                        max_num_batched_tokens=256, **kw))


@pytest.fixture(scope="module")
def probe(moe_checkpoint):
    """Sizing of an engine whose budget is far above its needs (the pool is capped)."""
    return _engine(moe_checkpoint[1], memory_budget_gib=1.0).kv_sizing


def _budget_gib(probe, num_blocks: int, margin: float = 0.05) -> float:
    """The budget that leaves ``num_blocks`` (+ half a block) for KV after weights, peak and margin."""
    need = probe.weights + probe.activation_peak + (num_blocks + 0.5) * probe.bytes_per_block
    return need / (1 - margin) / 2**30


@pytest.mark.parametrize("num_blocks", [40, 200])
def test_planner_predicts_measured_memory_within_10_percent(moe_checkpoint, probe, num_blocks):
    hf, path = moe_checkpoint
    assert probe.capped
    engine = _engine(path, memory_budget_gib=_budget_gib(probe, num_blocks), kv_memory_margin=0.05)
    s = engine.kv_sizing
    assert s.num_blocks == num_blocks
    assert s.source == "measured" and s.profiled_tokens == 256 and s.profiled_context == 512 and not s.capped
    assert s.decode_seqs == 16 and s.activation_peak == max(s.prefill_peak, s.decode_peak)
    # The worst prefill step is not the first chunk: the last chunk of the same 256 tokens reads twice the context
    # (profiling the first chunk alone, as the engine once did, undersizes; 16 decodes at 512 tokens come close).
    first_chunk = measure_prefill_peak(engine.model, 256, 16, torch.float32, torch.device("cpu"))
    assert s.prefill_peak > 1.1 * first_chunk and s.decode_peak > first_chunk, (s, first_chunk)
    dims = ModelDims.from_config(hf.config.to_dict())
    predicted = worst_step_activation_bytes(dims, 256, 16, 512, 1, 1, act_bytes=4)
    for step in ("prefill", "decode"):
        measured = getattr(s, f"{step}_peak")
        assert abs(predicted[step] - measured) <= 0.10 * measured, (step, predicted, s)
    assert abs(predicted["peak"] - s.activation_peak) <= 0.10 * s.activation_peak
    kv_tensors = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches)
    measured_per_token = kv_tensors / engine.kv_capacity_tokens
    assert abs(kv_bytes_per_token(dims, "fp32")["total"] - measured_per_token) <= 0.10 * measured_per_token
    # The rest of the budget went to KV: less than one block is left over after weights, peak and margin.
    left = s.budget - s.weights - s.activation_peak - s.margin - kv_tensors
    assert 0 <= left < s.bytes_per_block
    assert s.weights == tensor_bytes(engine.model)


def test_tracker_counts_new_storages_only():
    weight = torch.randn(64, 64)
    with StorageTracker() as tracker:
        a = weight @ weight  # 16 KiB
        view = a.t()
        b = a + 1  # 16 KiB more
        del a
        assert tracker.live == 2 * 16384  # the view keeps a's storage alive
        del view, b
    assert tracker.live == 0 and tracker.peak == 2 * 16384


def test_request_that_can_never_fit_is_refused_with_numbers(moe_checkpoint, probe):
    _, path = moe_checkpoint
    engine = _engine(path, memory_budget_gib=_budget_gib(probe, 8))  # 128 tokens of KV, max_model_len 256
    capacity = engine.kv_capacity_tokens
    assert capacity == 128
    with pytest.raises(RequestRejected) as err:
        engine.add_request([1] * (capacity - 4), SamplingParams(max_new_tokens=10, temperature=0))
    text = str(err.value)
    assert f"needs {capacity + 6} tokens" in text and f"holds {capacity}" in text
    assert "MiB budget" in text and "measured peak" in text and "bytes/token" in text
    assert probe.prefill_peak > probe.decode_peak  # a block of 128 queries' float32 scores outweighs 16 decodes
    assert f"measured peak {probe.prefill_peak / MIB:.1f} MiB (256-token prefill at 512 tokens)" in text  # the worst
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        _engine(path, memory_budget_gib=(probe.weights + probe.activation_peak) / 2**30)


def test_256_mixed_requests_stay_inside_the_sizing(moe_checkpoint, probe):
    _, path = moe_checkpoint
    # 384 tokens of KV for up to 64 sequences: prompts of 200 tokens take half the pool, so requests wait,
    # get preempted and resume.
    config = dict(block_size=16, max_model_len=256, max_num_seqs=64, max_num_batched_tokens=256)
    wide = LLMEngine.from_pretrained(path, EngineConfig(**config, memory_budget_gib=1.0)).kv_sizing  # 64 decodes
    engine = LLMEngine.from_pretrained(path, EngineConfig(**config, memory_budget_gib=_budget_gib(wide, 24)))
    s = engine.kv_sizing
    rng = random.Random(0)
    prompts = [[rng.randrange(160) for _ in range(rng.choice((1, 5, 17, 60, 130, 200)))] for _ in range(256)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 4), temperature=0.0, ignore_eos=True) for _ in prompts]
    fits = [len(p) + sp.max_new_tokens <= engine.kv_capacity_tokens for p, sp in zip(prompts, params)]
    with StorageTracker() as tracker:  # every activation the load allocates, step after step
        outputs = engine.generate(prompts, params)
    assert [o.finish_reason for o in outputs] == ["length" if f else "error" for f in fits]
    assert all(len(o.token_ids) == sp.max_new_tokens for o, sp, f in zip(outputs, params, fits) if f)
    assert tracker.peak <= s.activation_peak + s.margin  # never past what the sizing left for activations
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests
