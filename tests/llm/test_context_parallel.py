"""Context-parallel prefill: 2 ranks (gloo ring) give the greedy tokens and logits of the one-process engine, for
MLA (DeepSeek-V3) and sparse top-k attention (DeepSeek-V3.2 DSA), decoded from the paged layout by a bare model
and by a TP=2 engine that adopts the prefill. All 2-rank cases share one spawn (``cp_runs``)."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.context_parallel import ContextParallel, _RunningTopK, adopt_prefill, cp_prefill
from tests.collectives.harness import run_ranks
from tests.llm.checkpoints import random_prompts
from tests.llm.dsa_checkpoints import TOPK, make_hf_v32_model

NEW = 6
LENGTH = 150


@pytest.fixture(scope="module")
def v32_checkpoint(tmp_path_factory):
    model = make_hf_v32_model()
    path = tmp_path_factory.mktemp("deepseek_v32_cp")
    model.save_pretrained(path)
    return model, path


def _one_rank(path, prompt):
    """(greedy tokens, prefill logits of the last token) of the one-process engine."""
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=16, num_kv_blocks=16))
    tokens = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))[0]
    meta = AttentionMetadata.build([0], [len(prompt)], [list(range(10))], 16)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(prompt), meta, [torch.zeros_like(c) for c in engine.runner.kv_caches])
        logits = engine.model.compute_logits(hidden[-1:])[0]
    return tokens.token_ids, logits


@pytest.fixture(scope="module")
def cp_runs(moe_checkpoint, v32_checkpoint, tmp_path_factory):
    """{name: (one-rank tokens, one-rank logits, {rank: worker output})} for the MLA and DSA checkpoints."""
    prompts = {"mla": random_prompts(1, 160, (LENGTH,), seed=3)[0], "dsa": random_prompts(1, 160, (LENGTH,), seed=4)[0]}
    paths = {"mla": moe_checkpoint[1], "dsa": v32_checkpoint[1]}
    # Small tiles: several tiles per block, and tiles that see none of a block (skipped). The deadline allows for
    # a loaded machine (about 85 s with the CPUs mostly busy, over 300 s when other jobs leave ~1% of a core).
    cases = {name: dict(path=str(paths[name]), prompt=prompts[name], max_new_tokens=NEW, tile=32,
                        decode=("layout", "tp")) for name in paths}
    ranks = run_ranks("tests.llm.cp_workers:cp_suite", tmp_path_factory.mktemp("cp"), world=2, timeout_s=900,
                      cases=cases)
    return {name: (*_one_rank(paths[name], prompts[name]), {r: ranks[r][name] for r in ranks}) for name in paths}


@pytest.mark.parametrize("num_tokens, size", [(10, 2), (101, 2), (64, 4)])
def test_zigzag_shards_cover_the_prompt_once(num_tokens, size):
    shards = [ContextParallel(r, size).shard(num_tokens) for r in range(size)]
    assert sorted(torch.cat(shards).tolist()) == list(range(num_tokens))
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 2
    assert int(shards[0][-1]) == num_tokens - 1  # rank 0 holds the last token


def test_running_topk_over_blocks_equals_topk_over_the_prefix():
    torch.manual_seed(0)
    queries, length, k = 7, 40, 6
    scores = torch.randn(queries, length)
    visible = torch.tensor([3, 6, 7, 12, 25, 39, 40])  # fewer than k keys for the first queries
    scores[torch.arange(length)[None, :] >= visible[:, None]] = float("-inf")
    best = _RunningTopK(queries, k)
    for block in (torch.arange(20, 40), torch.arange(0, 11), torch.arange(11, 20)):  # any order
        best.merge(0, queries, scores[:, block], block)
    for q in range(queries):
        want = set(scores[q].topk(min(k, int(visible[q]))).indices.tolist())
        got = best.positions[q]
        assert set(got[got >= 0].tolist()) == want
        assert int((got < 0).sum()) == max(0, k - int(visible[q]))


def test_dsa_prefill_on_one_rank_matches_engine_and_topk_matters(v32_checkpoint):
    """The ring code with size 1 against the engine's sparse prefill; and attending densely instead would have
    been visible (so the 2-rank equality below tests the top-k)."""
    _, path = v32_checkpoint
    prompt = random_prompts(1, 160, (3 * TOPK,), seed=5)[0]
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=16, num_kv_blocks=4))
    result = cp_prefill(engine.model, prompt, ContextParallel(), tile=5)
    meta = AttentionMetadata.build([0], [len(prompt)], [[0, 1]], 16)
    caches = [torch.zeros_like(c) for c in engine.runner.kv_caches]
    with torch.inference_mode():
        ref = engine.model.compute_logits(engine.model(torch.tensor(prompt), meta, caches)[-1:])[0]
    torch.testing.assert_close(result.logits, ref, rtol=0, atol=1e-5)
    for rows, cache in zip(result.latents, caches):  # [c_kv, k_pe, indexer key] rows, as the engine caches them
        torch.testing.assert_close(rows, cache.view(-1, cache.shape[-1])[: len(prompt)], rtol=0, atol=1e-5)
    for layer in engine.model.model.layers:
        layer.self_attn.sparse = False
    dense = cp_prefill(engine.model, prompt, ContextParallel(), tile=5)
    assert (dense.logits - ref).abs().max() > 1e-3


def test_adopt_refuses_rows_of_another_model(v32_checkpoint, moe_checkpoint):
    engine = LLMEngine.from_pretrained(moe_checkpoint[1], EngineConfig(block_size=16, num_kv_blocks=4))
    v32 = LLMEngine.from_pretrained(v32_checkpoint[1], EngineConfig(block_size=16, num_kv_blocks=4))
    prompt = random_prompts(1, 160, (20,), seed=6)[0]
    result = cp_prefill(v32.model, prompt, ContextParallel())
    with pytest.raises(ValueError, match="do not fit this engine"):
        adopt_prefill(engine, prompt, result)
    assert not engine.has_unfinished_requests and engine.block_manager.num_free_blocks == 4


@pytest.mark.parametrize("name", ["mla", "dsa"])
def test_cp2_prefill_matches_one_rank(cp_runs, name):
    expected, ref_logits, ranks = cp_runs[name]
    for rank, out in ranks.items():
        assert out["tokens"] == expected, rank
    assert ranks[0]["logits"] == ranks[1]["logits"]
    assert (ranks[0]["shard"], ranks[1]["shard"]) == (76, 74)  # zigzag of 150: 38 + 38 and 37 + 37
    assert ranks[0]["row"] == (56 if name == "dsa" else 40)  # V3.2 rows carry the 16-wide indexer key
    # Logits within float32 tolerance of the one-rank engine's prefill (same model, other summation order).
    torch.testing.assert_close(torch.tensor(ranks[0]["logits"]), ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["mla", "dsa"])
def test_cp2_prefill_then_tp2_engine_decode(cp_runs, name):
    expected, _, ranks = cp_runs[name]
    for rank, out in ranks.items():
        assert out["tp"]["tokens"] == expected, rank
        assert out["tp"]["local_heads"] == 2  # 4 heads split over TP=2: the decode layout is not the prefill's
        assert out["tp"]["free_blocks"] == out["tp"]["num_blocks"]  # the adopted request released its blocks
