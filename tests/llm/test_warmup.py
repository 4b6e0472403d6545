"""Engine warm-up (``llm/warmup.py``): it compiles the step shapes the scheduler produces, later requests compile
nothing (dynamo's graph counter), and it leaves no request, block, cached prefix or counter behind."""

from __future__ import annotations

import pytest

from metainfer_gen.kernels import norm, rotary
from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from tests.llm.checkpoints import random_prompts

BUDGET = 64  # max_num_batched_tokens: the full-budget step is the one large shape


@pytest.fixture
def compile_small_shapes(monkeypatch):
    """Let the compiled RMSNorm / RoPE paths take a tiny model's full-budget step (as a large model's would), and
    start from nothing compiled (dynamo reset), and forget the registry's cached decisions before and after."""
    import torch._dynamo

    torch._dynamo.reset()
    for path in (norm._compiled, norm._fused_compiled, rotary._compiled):
        monkeypatch.setattr(path, "min_numel", BUDGET * 16)
        monkeypatch.setattr(path, "_signatures", set())
        monkeypatch.setattr(path, "_compiled", None)
    ops = (norm.RMS_NORM, norm.FUSED_ADD_RMS_NORM, rotary.ROPE)
    for op in ops:
        op.clear_decisions()
    yield
    for op in ops:
        op.clear_decisions()


def make(path) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=BUDGET,
                                                        max_model_len=128, num_kv_blocks=256))


def test_after_warm_up_requests_compile_nothing_and_answer_as_without(moe_checkpoint, compile_small_shapes):
    from torch._dynamo.utils import counters

    model, path = moe_checkpoint
    vocab = model.config.vocab_size
    prompts = random_prompts(12, vocab, (5, 17, 40, 64, 90), seed=3)  # chunks of 64 and partial ones
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    engine = make(path)
    report = engine.warmup()
    assert report.prefill_tokens == (BUDGET,) and report.decode_batches == (1, 2, 4, 8)
    assert report.num_graphs_compiled >= 1  # the full-budget step reached a compiled path
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm._hash_to_block
    assert (bm.num_prefix_queries, bm.num_prefix_hits, engine.scheduler.num_preemptions) == (0, 0, 0)
    assert not engine.has_unfinished_requests and not engine._requests
    graphs = counters["stats"]["unique_graphs"]
    warm = [o.token_ids for o in engine.generate(prompts, params)]
    assert counters["stats"]["unique_graphs"] == graphs  # partial chunks of other sizes ran eager, not compiled
    cold = make(path)  # not warmed: compiles the partial chunks' sizes as it meets them
    assert warm == [o.token_ids for o in cold.generate(prompts, params)]
    assert counters["stats"]["unique_graphs"] > graphs  # so the check above could have failed


def test_warm_up_refuses_an_engine_with_open_requests(moe_checkpoint):
    engine = make(moe_checkpoint[1])
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="warm up before adding requests"):
        engine.warmup()


def test_the_warm_up_prefill_fits_the_scratch_blocks_it_was_sized_from():
    """A budget of exactly the scratch capacity splits into prompts that need no more blocks than it has (1023 +
    1 tokens would need 65 blocks of 16 for 1,024 tokens, and the warm-up would run out)."""
    from metainfer_gen.llm.warmup import prefill_split

    for budget, max_prompt_len, block_size in ((1024, 1023, 16), (4096, 1023, 16), (100, 7, 16), (2048, 2047, 64)):
        prompts = prefill_split(budget, max_prompt_len, block_size)
        assert sum(prompts) == budget and max(prompts) <= max_prompt_len
        assert sum(-(-n // block_size) for n in prompts) == -(-budget // block_size) or block_size > max_prompt_len
