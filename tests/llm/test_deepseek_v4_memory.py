"""DeepSeek-V4's activation memory against the context (``llm/layers/v4_paged_attention.py`` scores query rows in
tiles of ``ROW_TILE_ELEMENTS``; CSA attends to its top-k entries gathered, not to every entry under a mask;
``llm/layers/v4_entries.py`` reads compressed entries ``ENTRY_TILE_TOKENS`` of context at a time): the peak of the
worst prefill chunk and of a decode step grows at most 10% from 8K to 32K context, and tiles of a few rows or a few
entries give transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.memory_profile import measure_decode_peak, measure_prefill_peak
from tests.llm.checkpoints import hf_greedy, random_prompts
from tests.llm.test_deepseek_v4_engine import CSA, HCA, SLIDING, _save
from tests.llm.v4_checkpoints import V4

CHUNK = 512


def _model(max_positions: int):
    """The engine's V4 at the test shapes with window 128 and rates 4 / 128 (random weights)."""
    from transformers import AutoConfig

    from metainfer_gen.llm.models.deepseek_v4_engine import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v4", bos_token_id=None, eos_token_id=None, **{
        **V4, "sliding_window": 128, "compress_rates": {CSA: 4, HCA: 128}, "max_position_embeddings": max_positions})
    model = DeepseekV4ForCausalLM(config, max_positions).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.normal_(0, 0.05)
    return model


def test_prefill_chunk_peak_grows_at_most_10_percent_from_8k_to_32k():
    """The last 512-token chunk of an 8K and of a 32K context (sliding, CSA and HCA layers): the indexer's scores
    over every CSA entry (chunk x context / 4) and the attention over the entries are held a few rows at a time."""
    model = _model(32768)
    cpu = torch.device("cpu")
    peaks = {ctx: measure_prefill_peak(model, CHUNK, 16, torch.float32, cpu, context=ctx) for ctx in (8192, 32768)}
    assert peaks[32768] <= 1.10 * peaks[8192], peaks
    decode = {ctx: measure_decode_peak(model, 1, ctx, 16, torch.float32, cpu) for ctx in (8192, 32768)}
    assert decode[32768] < peaks[8192] / 10, decode  # a decode step reads the context, far below a chunk's peak


def test_decode_peak_grows_at_most_10_percent_from_8k_to_32k():
    """One decode token at 8K and 32K on a filled cache (each sequence its own blocks of random values): the CSA
    indexer's keys and scores and HCA's entries are read 8K tokens of context at a time and no per-token list of
    the context is built; what still grows is the block table (one int64 per 16 tokens). On the profiler's scratch
    block every entry ties, so the indexer also holds its whole row of scores: one float32 per CSA entry."""
    model = _model(32768)
    cpu = torch.device("cpu")
    filled = {ctx: measure_decode_peak(model, 1, ctx, 16, torch.float32, cpu, filled=True) for ctx in (8192, 32768)}
    assert filled[32768] <= 1.10 * filled[8192], filled
    tied = measure_decode_peak(model, 1, 32768, 16, torch.float32, cpu)
    assert tied <= filled[32768] + 4 * (32768 // 4) + 1024, (tied, filled)


@pytest.mark.parametrize("module, name, value", [("v4_paged_attention", "ROW_TILE_ELEMENTS", 400),
                                                ("v4_entries", "ENTRY_TILE_TOKENS", 8)])
def test_small_tiles_give_transformers_tokens(tmp_path, monkeypatch, module, name, value):
    """Tiles of one to a few query rows (the indexer's top-k still sees each query's whole row, so its ties at 0
    break as in one call), or of 8 tokens of context (two CSA entries, one HCA entry: the indexer's running top-k,
    its ties at 0 across the k-th place sent to one whole-row top-k, and HCA's online softmax); chunked prefill
    mixed with decodes."""
    import importlib

    monkeypatch.setattr(importlib.import_module(f"metainfer_gen.llm.layers.{module}"), name, value)
    model = _save(tmp_path, [CSA, SLIDING, HCA])
    prompts = random_prompts(4, model.config.vocab_size, (45, 70, 33, 62), seed=4)
    expected = [hf_greedy(model, p, 12) for p in prompts]
    engine = LLMEngine.from_pretrained(tmp_path, EngineConfig(block_size=8, dtype="float32", max_num_seqs=4,
                                                              max_num_batched_tokens=32))
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
