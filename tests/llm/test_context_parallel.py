"""Context-parallel prefill: 2 ranks (gloo ring) give the greedy tokens and logits of the one-process engine."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.context_parallel import ContextParallel
from tests.collectives.harness import run_ranks
from tests.llm.checkpoints import random_prompts


@pytest.mark.parametrize("num_tokens, size", [(10, 2), (101, 2), (64, 4)])
def test_zigzag_shards_cover_the_prompt_once(num_tokens, size):
    shards = [ContextParallel(r, size).shard(num_tokens) for r in range(size)]
    assert sorted(torch.cat(shards).tolist()) == list(range(num_tokens))
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 2
    assert int(shards[0][-1]) == num_tokens - 1  # rank 0 holds the last token


def test_cp2_prefill_matches_one_rank(moe_checkpoint, tmp_path):
    _, path = moe_checkpoint
    prompt = random_prompts(1, 160, (150,), seed=3)[0]
    new = 6
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=16, num_kv_blocks=16))
    expected = engine.generate([prompt], SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))[0]
    ranks = run_ranks("tests.llm.cp_workers:cp_prefill_decode", tmp_path, world=2, path=str(path), prompt=prompt,
                      max_new_tokens=new, tile=32)  # small tiles: several tiles and skipped tiles per block
    for rank, out in ranks.items():
        assert out["tokens"] == expected.token_ids, rank
    assert ranks[0]["logits"] == ranks[1]["logits"]
    assert (ranks[0]["shard"], ranks[1]["shard"]) == (76, 74)  # zigzag of 150: 38 + 38 and 37 + 37
    # Logits within float32 tolerance of the one-rank engine's prefill (same model, other summation order).
    from metainfer_gen.llm.attention_metadata import AttentionMetadata

    meta = AttentionMetadata.build([0], [len(prompt)], [list(range(10))], 16)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(prompt), meta, [torch.zeros_like(c) for c in engine.runner.kv_caches])
        ref = engine.model.compute_logits(hidden[-1:])[0]
    torch.testing.assert_close(torch.tensor(ranks[0]["logits"]), ref, rtol=1e-4, atol=1e-4)
