"""The planner's DeepSeek-V4 rows: parameter and byte counts against transformers' ``DeepseekV4ForCausalLM``, state
bytes against ``v4_state_bytes``, the 1M-token rows on 8 x 48 GiB and 8 x 141 GiB, the CLI, and bad input."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from metainfer_gen.apps.cli import main
from metainfer_gen.llm.plan import GIB, Hardware
from metainfer_gen.llm.plan_model import read_config
from metainfer_gen.llm.plan_v4 import v4_state_bytes
from metainfer_gen.llm.plan_v4_capacity import make_v4_plan, v4_step_activation_bytes
from metainfer_gen.llm.plan_v4_model import (V4Dims, v4_num_parameters, v4_state_bytes_per_sequence, v4_tensors,
                                             v4_weight_bytes_per_rank)
from tests.llm.v4_checkpoints import V4

FLASH = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "deepseek_v4_flash.json"
MILLION = 1_048_576
_C, _H, _S = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
SHAPES = [  # every layer type, both routers; a tied head, hc_mult 3, four groups; all-hash, all-CSA, odd rates
    {},
    dict(num_hidden_layers=4, layer_types=[_H, _C, _C, _S], mlp_layer_types=["moe"] * 4, hc_mult=3, o_groups=4,
         tie_word_embeddings=True, n_routed_experts=6, num_experts_per_tok=3),
    dict(num_hidden_layers=2, layer_types=[_C, _C], mlp_layer_types=["hash_moe"] * 2, index_n_heads=2,
         q_lora_rank=24, compress_rates={_C: 2, _H: 16}, moe_intermediate_size=48, intermediate_size=None),
]
# transformers' parameter names -> the planner's groups (first match wins)
_GROUPS = [("embed_tokens", "embed"), ("lm_head", "lm_head"), ("model.norm.", "final_norm"), ("hc_head", "hc_head"),
           ("indexer.q_b_proj", "indexer.q_b"), ("indexer.position_bias", "indexer.bias_norm"),
           ("indexer.kv_norm", "indexer.bias_norm"), ("indexer.", "indexer.proj"),
           ("compressor.kv_proj", "compressor.proj"), ("compressor.gate_proj", "compressor.proj"),
           ("compressor.", "compressor.bias_norm"), ("q_a_proj", "attn.q_a"), ("q_b_proj", "attn.q_b"),
           ("self_attn.kv_proj", "attn.kv"), ("o_a_proj", "attn.o_a"), ("o_b_proj", "attn.o_b"),
           ("sinks", "attn.sinks"), ("self_attn.", "attn.norms"), ("_hc.", "hc"), ("layernorm", "layer_norms"),
           ("mlp.experts.", "experts"), ("shared_experts", "shared_experts"), ("mlp.gate.weight", "router"),
           ("tid2eid", "router.tid2eid"), ("e_score_correction_bias", "router.bias")]


def _config(overrides: dict):
    from transformers import AutoConfig

    kwargs = {k: v for k, v in {**V4, **overrides}.items() if v is not None}
    return AutoConfig.for_model("deepseek_v4", bos_token_id=None, eos_token_id=None, **kwargs)


def _router_buffers(model):
    return [(n, b) for n, b in model.named_buffers() if n.endswith(("tid2eid", "e_score_correction_bias"))]


def _stored_bytes(model) -> int:
    """Bytes of every parameter and router buffer as transformers holds them."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *(b for _, b in _router_buffers(model))])


def _by_group(model) -> Counter:
    out = Counter()
    for name, t in list(model.named_parameters()) + _router_buffers(model):
        out[next(g for key, g in _GROUPS if key in name)] += t.numel()
    return out


@pytest.mark.parametrize("overrides", SHAPES, ids=["three-types", "tied-hc3", "all-hash-csa"])
def test_parameter_counts_and_bf16_bytes_equal_transformers(overrides):
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(overrides)
    d = V4Dims.from_config(config.to_dict())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert v4_num_parameters(d) == sum(p.numel() for p in model.parameters())
    assert _by_group(model) == Counter({t.name: t.numel for t in v4_tensors(d) if t.numel})
    # transformers keeps the hyper-connections, sinks, position biases and norms in float32 under bf16
    half = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert v4_weight_bytes_per_rank(d, "bf16", 1, 1) == _stored_bytes(half)


def test_v4_flash_on_the_meta_device_matches_every_parameter_and_byte():
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    cfg = read_config(FLASH)
    d = V4Dims.from_config(cfg)
    config = DeepseekV4Config.from_dict({k: v for k, v in cfg.items() if k != "_comment"})  # as config.json loads
    with torch.device("meta"):  # shapes only: no memory behind the 284B parameters
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert v4_num_parameters(d) == sum(p.numel() for p in model.parameters()) == 284_325_869_015
    assert v4_weight_bytes_per_rank(d, "bf16", 1, 1) == _stored_bytes(model)
    assert (d.num_csa_layers, d.num_hca_layers, d.num_hash_layers) == (20, 23, 3)


def test_weights_split_over_ranks():
    d = V4Dims.from_config(read_config(FLASH))
    whole = v4_weight_bytes_per_rank(d, "fp8", 1, 1)
    tp8 = v4_weight_bytes_per_rank(d, "fp8", 8, 8)
    replicated = sum(t.numel for t in v4_tensors(d) if t.split == "replicated" and t.storage == "fp32") * 4
    assert replicated < tp8 < whole / 7.5  # all but the replicated parts (compressors, indexer, q_a, kv) split
    assert v4_weight_bytes_per_rank(d, "fp8", 1, 8) > tp8  # DP attention keeps every head on each rank
    assert v4_weight_bytes_per_rank(d, "fp8", 8, 8) < v4_weight_bytes_per_rank(d, "bf16", 8, 8) / 1.9


@pytest.mark.parametrize("context", [8192, 32768, MILLION])
def test_state_bytes_per_sequence_equal_v4_state_bytes(context):
    cfg = read_config(FLASH)
    d = V4Dims.from_config(cfg)
    for fmt, size in (("bf16", 2), ("fp8", 1)):
        assert v4_state_bytes_per_sequence(d, context, fmt) == v4_state_bytes(cfg, context, size)["total"]
    plan = make_v4_plan(d, Hardware(8, 141 * GIB), context=context)
    assert plan["state_bytes_per_sequence"]["bf16"] == v4_state_bytes(cfg, context, 2)
    assert plan["rows"][0]["state_gib"] * GIB == v4_state_bytes(cfg, context, 2)["total"]


def test_state_at_one_million_tokens_by_hand():
    # 20 CSA layers keep (512 + 128) values per 4 tokens, 23 HCA layers 512 per 128; every layer 127 window rows;
    # 1M is a multiple of 4, so only CSA's last Ca half (kv and gate, both compressors) is pending.
    d = V4Dims.from_config(read_config(FLASH))
    per_token = (20 * 640 / 4 + 23 * 512 / 128) * 2
    expected = per_token * MILLION + 43 * 127 * 512 * 2 + 20 * 2 * 4 * (512 + 128) * 2
    assert v4_state_bytes_per_sequence(d, MILLION, "bf16") == expected == 6_909_621_248


def test_activation_bound_grows_with_the_indexer_entries():
    d = V4Dims.from_config(read_config(FLASH))
    n = 8192
    at = {t: v4_step_activation_bytes(d, n, t, 8) for t in (MILLION // 2, MILLION)}
    # blockwise: only the CSA indexer's (n, context / 4) float32 logits grow with the context
    assert at[MILLION]["peak"] - at[MILLION // 2]["peak"] == 4 * n * (MILLION // 4 - MILLION // 8)
    dense = v4_step_activation_bytes(d, n, MILLION, 1, attention="materialised")
    assert dense["attention"] >= 8 * n * 64 * (128 + MILLION // 128)  # HCA's scores over every entry at once
    assert dense["peak"] > v4_step_activation_bytes(d, n, MILLION, 1)["peak"] > at[MILLION]["peak"]


def _rows(memory_gib: int) -> dict:
    plan = make_v4_plan(V4Dims.from_config(read_config(FLASH)), Hardware(8, memory_gib * GIB), context=MILLION)
    return {(r["layout"], r["weight_format"]): r for r in plan["rows"]}


def test_one_million_token_rows_on_48_and_141_gib():
    small, big = _rows(48), _rows(141)
    assert set(small) == set(big) == {(l, f) for l in ("TP", "DP attention") for f in ("bf16", "fp8")}
    for key, row in big.items():
        assert row["fits"] and row["seqs_per_rank"] > small[key]["seqs_per_rank"]
        assert row["seqs_total"] == row["seqs_per_rank"] * (1 if key[0] == "TP" else 8)
    for rows in (small, big):
        for layout in ("TP", "DP attention"):
            bf16, fp8 = rows[(layout, "bf16")], rows[(layout, "fp8")]
            assert fp8["weights_gib"] < bf16["weights_gib"] and fp8["kv_budget_gib"] >= bf16["kv_budget_gib"]
            assert fp8["seqs_per_rank"] >= bf16["seqs_per_rank"]
            assert rows is small or fp8["seqs_per_rank"] > bf16["seqs_per_rank"]
    assert not small[("TP", "bf16")]["fits"] and "exceed" in small[("TP", "bf16")]["reason"]
    tp_fp8 = small[("TP", "fp8")]
    assert 0 < tp_fp8["longest_context"] < MILLION and "under one sequence" in tp_fp8["reason"]


@pytest.mark.parametrize("memory_gib", [48, 141])
def test_rows_are_the_most_that_fit(memory_gib):
    hw = Hardware(8, memory_gib * GIB)
    for row in _rows(memory_gib).values():
        budget = hw.device_memory * (1 - hw.margin) - hw.reserve - row["weights_gib"] * GIB
        seqs, state = row["seqs_per_rank"], row["state_gib"] * GIB
        if seqs:
            assert row["activation_gib"] * GIB + seqs * state <= budget + 1
        assert row["activation_gib"] * GIB + (seqs + 1) * state > budget


def test_cli_prints_the_v4_rows(capsys):
    args = ["plan", "--model", str(FLASH), "--devices", "8", "--max-context", str(MILLION), "--kv", "bf16"]
    assert main(args + ["--device-memory", "48GiB"]) == 0
    text = capsys.readouterr().out
    assert "| TP8 (state replicated) | fp8 | 34.4 |" in text and "| 6909621248 |" in text and "does not fit" in text
    assert main(args + ["--device-memory", "141GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["request"]["context"] == MILLION and all(r["fits"] for r in out["rows"])
    assert main(args[:-2] + ["--max-context", str(MILLION + 1)]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("o_groups"), "o_groups"),
    (lambda c: c.pop("compress_rates"), "compress_rates"),
    (lambda c: c.update(layer_types=c["layer_types"][:-1]), "layer_types has 42 entries"),
    (lambda c: c["mlp_layer_types"].__setitem__(0, "dense"), "mlp_layer_types entries"),
    (lambda c: c.update(n_shared_experts=2), "exactly one shared expert"),
    (lambda c: c.update(compress_rates={_C: 4}), "lacks"),
])
def test_bad_configs_are_refused_by_name(change, message):
    cfg = read_config(FLASH)
    change(cfg)
    with pytest.raises(ValueError, match=message):
        V4Dims.from_config(cfg)


def test_bad_requests_are_refused():
    d = V4Dims.from_config(read_config(FLASH))
    with pytest.raises(ValueError, match="max_position_embeddings=1048576"):
        make_v4_plan(d, Hardware(8, 48 * GIB), context=MILLION + 1)
    with pytest.raises(ValueError, match="KV format"):
        make_v4_plan(d, Hardware(8, 48 * GIB), kv_format="int4")
    with pytest.raises(ValueError, match="weight format"):
        v4_weight_bytes_per_rank(d, "fp4", 8, 8)
