"""Tensor parallelism: the sharded layers reproduce the full ones, and a TP=2 engine (2 CPU ranks, gloo + shared
memory) generates the same greedy tokens as TP=1 on the tiny checkpoints."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from metainfer_gen.llm.layers.linear import ColumnParallelLinear, RowParallelLinear
from metainfer_gen.llm.parallel import TensorParallel
from tests.collectives.harness import run_ranks
from tests.llm.checkpoints import CONFIGS, make_hf_model, random_prompts

MAX_NEW = 12


def _shards(make, full: torch.Tensor, size: int = 2) -> list[torch.Tensor]:
    return [make(TensorParallel(rank, size)).weight.tp_shard.take(full) for rank in range(size)]


def test_column_and_row_shards_recompose_the_full_linear():
    torch.manual_seed(0)
    w, x = torch.randn(12, 10), torch.randn(5, 10)
    cols = _shards(lambda tp: ColumnParallelLinear(10, 12, tp=tp), w)
    assert [c.shape for c in cols] == [(6, 10), (6, 10)]
    torch.testing.assert_close(torch.cat([x @ c.T for c in cols], dim=1), x @ w.T)
    rows = _shards(lambda tp: RowParallelLinear(10, 12, tp=tp), w)
    assert [r.shape for r in rows] == [(12, 5), (12, 5)]
    torch.testing.assert_close(x[:, :5] @ rows[0].T + x[:, 5:] @ rows[1].T, x @ w.T)


def test_vocab_shards_pad_an_indivisible_vocabulary():
    table = torch.randn(7, 4)
    shards = _shards(lambda tp: VocabParallelEmbedding(7, 4, tp), table)
    assert [s.shape for s in shards] == [(4, 4), (4, 4)]
    torch.testing.assert_close(torch.cat(shards)[:7], table)
    assert torch.equal(shards[1][3], torch.zeros(4))  # padding row
    head = _shards(lambda tp: ParallelLMHead(4, 7, tp), table)
    torch.testing.assert_close(torch.cat(head)[:7], table)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_indivisible_sizes_raise(name):
    from metainfer_gen.llm.models.deepseek_v3 import DeepseekV3ForCausalLM

    config = make_hf_model(name).config
    with torch.device("meta"), pytest.raises(ValueError, match="not divisible by tensor_parallel_size=3"):
        DeepseekV3ForCausalLM(config, 64, TensorParallel(0, 3))


def test_tp_size_validated():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_tp2_greedy_tokens_equal_tp1(hf_checkpoint, tmp_path):
    model, path = hf_checkpoint
    vocab = model.config.vocab_size
    prompts = random_prompts(6, vocab, (1, 5, 12, 17))
    logit_prompt = random_prompts(1, vocab, (37,), seed=5)[0]
    tp1 = LLMEngine.from_pretrained(path, EngineConfig(block_size=4, max_num_batched_tokens=96))
    meta = AttentionMetadata.build([0], [len(logit_prompt)], [list(range(10))], 4)
    with torch.inference_mode():
        ref_logits = tp1.model.compute_logits(tp1.model(torch.tensor(logit_prompt), meta, tp1.runner.kv_caches))
    tp1.runner.kv_caches = [torch.zeros_like(c) for c in tp1.runner.kv_caches]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in tp1.generate(prompts, params)]

    results = run_ranks("tests.llm.tp_workers:greedy_tp", tmp_path, timeout_s=300, path=str(path), prompts=prompts,
                        logit_prompt=logit_prompt, max_new_tokens=MAX_NEW)
    heads = model.config.num_attention_heads
    for rank, out in results.items():
        assert out["tokens"] == expected, f"rank {rank}"
        torch.testing.assert_close(torch.tensor(out["logits"]), ref_logits, atol=1e-5, rtol=0)
        assert out["local_heads"] == heads // 2
        assert out["paths"]["all_reduce"] == {"shm_one_shot": out["paths"]["all_reduce"]["shm_one_shot"]}
        assert out["paths"]["all_gather"].keys() == {"shm_all_gather"}
        # the audit names the layer that reduces (linear.py, embedding.py ...), not the TP helper in parallel.py
        files = {site.split(":")[0] for site in out["sites"]}
        assert "parallel.py" not in files and {"linear.py", "embedding.py"} <= files, out["sites"]
    assert results[0]["logits"] == results[1]["logits"]  # every rank samples from the same logits
    experts = [set(results[r]["local_experts"]) for r in (0, 1)]
    assert not experts[0] & experts[1]  # routed experts split, none duplicated


def test_engine_tp2_under_torchrun(moe_checkpoint, tmp_path):
    """The documented launch: ``torchrun --nproc-per-node 2`` with EngineConfig(tensor_parallel_size=2)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    model, path = moe_checkpoint
    prompts = random_prompts(3, model.config.vocab_size, (4, 9), seed=3)
    tp1 = LLMEngine.from_pretrained(path, EngineConfig(block_size=4))
    expected = [o.token_ids for o in tp1.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                            ignore_eos=True))]
    out = tmp_path / "tokens.json"
    script = Path(__file__).with_name("tp_torchrun_main.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "METAINFER_COLLECTIVES_TUNE": "0",
           "METAINFER_COLLECTIVES_CACHE": str(tmp_path / "collectives.json")}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(_free_port()), str(script), str(path), str(out),
                             json.dumps(prompts), "6"],
                            capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["tokens"] == expected
    assert got["last_path"].startswith("shm_")
    assert got["run_id"]  # torchrun's job id, which keys the shared-memory segment names


def _free_port() -> int:
    from metainfer_gen.collectives.distributed import free_port

    return free_port()
