"""DeepSeek-V4 under tensor parallelism: a TP=2 engine (2 CPU ranks, gloo + shared memory) generates transformers'
greedy tokens on two layer-type mixes (a hash-routed first layer in both) with chunked prefill, each rank holding
only its shard of the split weights; under ``Lockstep`` (rank 0 schedules) the followers free finished sequences'
compressor state too; indivisible sizes are refused before any process group."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine
from metainfer_gen.llm.models.v4_tensor_parallel import check_v4_tensor_parallel
from tests.collectives.harness import run_ranks
from tests.llm.checkpoints import hf_greedy, random_prompts
from tests.llm.test_deepseek_v4_engine import CSA, HCA, SLIDING, _save

MIXES = [([SLIDING, CSA, HCA], 16), ([HCA, CSA, CSA], 4)]  # HCA's rate 8 above block size 4 in the second
LENGTHS = (45, 70, 33, 62)  # past the sliding window (16), over many CSA (4) and HCA (8) windows
NEW = 12
# Split tensors of the first layer (hash-routed MoE) and the vocabulary, with the dimension each is split along.
SPLIT = {"model.layers.0.self_attn.q_b_proj.weight": 0, "model.layers.0.self_attn.sinks": 0,
         "model.layers.0.self_attn.o_a_proj.weight": 0, "model.layers.0.self_attn.o_b_proj.weight": 1,
         "model.layers.0.mlp.experts.gate_up_proj": 0, "model.layers.0.mlp.shared_experts.down_proj.weight": 1,
         "model.embed_tokens.weight": 0, "lm_head.weight": 0}
REPLICATED = ("model.layers.0.self_attn.kv_proj.weight", "model.layers.0.mlp.gate.tid2eid")


def test_tp2_greedy_tokens_equal_transformers(tmp_path):
    """Prompts of 33-70 tokens in 13-token steps (chunks ending inside CSA and HCA windows, mixed with decodes)."""
    runs, expected, models = [], [], []
    prompts = random_prompts(len(LENGTHS), 128, LENGTHS, seed=4)
    for i, (types, block_size) in enumerate(MIXES):
        path = tmp_path / f"v4_{i}"
        models.append(_save(path, types))
        runs.append((str(path), block_size))
        expected.append([hf_greedy(models[-1], p, NEW) for p in prompts])
    results = run_ranks("tests.llm.tp_workers:greedy_v4_tp", tmp_path, timeout_s=150, runs=runs, prompts=prompts,
                        max_new_tokens=NEW, budget=13, weights=[*SPLIT, *REPLICATED])
    for rank, out in results.items():
        for run, model, want in zip(out["runs"], models, expected):
            assert run["tokens"] == want, f"rank {rank}"
            assert run["states_left"] == 0
            full = model.state_dict()
            for name, dim in SPLIT.items():
                size = full[name].shape[dim] // 2
                assert torch.equal(torch.tensor(run["weights"][name]), full[name].narrow(dim, rank * size, size)), name
            for name in REPLICATED:
                assert torch.equal(torch.tensor(run["weights"][name]), full[name]), name


def test_lockstep_followers_free_finished_sequences_state(tmp_path):
    """Rank 0 leads (the serving launch), rank 1 follows: rank 0's tokens are transformers', and the follower,
    which never sees a sequence finish, frees each one's compressor state when rank 0 says it released it."""
    model = _save(tmp_path / "v4", MIXES[0][0])
    prompts = random_prompts(len(LENGTHS), 128, LENGTHS, seed=4)
    expected = [hf_greedy(model, p, NEW) for p in prompts]
    results = run_ranks("tests.llm.tp_workers:lockstep_v4", tmp_path, timeout_s=150, path=str(tmp_path / "v4"),
                        block_size=MIXES[0][1], prompts=prompts, max_new_tokens=NEW, budget=13)
    assert results[0]["tokens"] == expected
    assert results[1]["steps"] > 0
    assert results[0]["states_left"] == results[1]["states_left"] == 0


def test_indivisible_tp_size_is_refused_before_any_process_group(tmp_path):
    """4 heads, 2 output groups, 32 shared-expert columns, 4 experts: 3 divides none of them, 4 not the groups."""
    model = _save(tmp_path, [SLIDING, CSA, HCA])
    with pytest.raises(ValueError, match=r"deepseek_v4 cannot be split over tensor_parallel_size=3: "
                                         r"num_attention_heads=4 is not divisible by it; o_groups=2 is not divisible "
                                         r"by it; intermediate_size=32 is not divisible by it .* use "
                                         r"tensor_parallel_size in \[1, 2\]"):
        LLMEngine.from_pretrained(tmp_path, EngineConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4: o_groups=2 is not divisible by it"):
        LLMEngine.from_pretrained(tmp_path, EngineConfig(tensor_parallel_size=4))
    check_v4_tensor_parallel(model.config, 2)  # heads, groups, columns and experts all split in two
    with pytest.raises(ValueError, match="n_routed_experts=4 is below it"):
        check_v4_tensor_parallel(model.config.__class__(**{**model.config.to_dict(), "num_attention_heads": 8,
                                                           "o_groups": 8, "intermediate_size": 64}), 8)
