"""The planner against published numbers and its own arithmetic; the ``metainfer-gen plan`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metainfer_gen.apps.cli import main
from metainfer_gen.apps.plan_cmd import parse_bytes
from metainfer_gen.llm.plan import GIB, Hardware, make_plan
from metainfer_gen.llm.plan_activations import worst_step_activation_bytes
from metainfer_gen.llm.plan_model import ModelDims, kv_bytes_per_token, weight_bytes_per_rank

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def test_deepseek_v32_sizes_match_published_figures():
    d = ModelDims.from_path(CONFIGS / "deepseek_v32.json")
    kv = kv_bytes_per_token(d, "bf16")
    assert kv["latent"] == 61 * 576 * 2 and kv["indexer"] == 61 * 128 * 2
    # The engine's FP8 cache (kv_cache_dtype="fp8"): one e4m3 byte per value of the row, scale 1.
    assert kv_bytes_per_token(d, "fp8")["latent"] == 61 * 576 and kv_bytes_per_token(d, "fp8")["indexer"] == 61 * 128
    params = weight_bytes_per_rank(d, "bf16", 1, 1) / 2
    assert 671e9 < params < 690e9  # 671B main model + the DSA indexers
    assert weight_bytes_per_rank(d, "fp8", 8, 8) < weight_bytes_per_rank(d, "fp8", 4, 8)


def test_plan_context_and_concurrency_agree():
    d = ModelDims.from_path(CONFIGS / "deepseek_v32.json")
    hw = Hardware(num_devices=8, device_memory=80 * GIB, interconnect="pcie")
    plan = make_plan(d, hw, concurrency=16, max_context=32768)
    p, base = plan["not_built"], plan["baseline"]
    assert p["max_context_uncapped"] >= 32768 and p["max_concurrency"] >= 16
    assert base["max_concurrency"] < 16 and base["decode"] == {"tp": 8, "dcp": 1}
    # The per-token KV a rank holds, times the context and the rows per token, fits the KV budget.
    rows = max(15 / p["decode"]["dcp"] + 1 / p["prefill"]["cp"], 16 / p["decode"]["dcp"])
    assert rows * p["max_context_uncapped"] * p["kv_token_bytes"] <= p["kv_budget_gib"] * GIB
    assert p["prefill"]["tp"] * p["prefill"]["cp"] == 8 and "TP=" in p["reasons"]["decode"]


def test_plan_recommends_only_what_the_engine_runs():
    d = ModelDims.from_path(CONFIGS / "deepseek_v32.json")
    # 8 x 48 GiB: FP8 weights (80 GiB/rank) leave no KV; the layout that fits needs int4, CP and DCP, none built.
    plan = make_plan(d, Hardware(8, 48 * GIB), concurrency=16)
    p, nb = plan["plan"], plan["not_built"]
    assert p["not_built"] == [] and p["prefill"] == {"tp": 8, "cp": 1} and p["decode"] == {"tp": 8, "dcp": 1}
    assert p["weight_format"] == "fp8" and p["capacity_tokens"] == 0 and "does not fit" in p["reasons"]["decode"]
    assert nb["weight_format"] == "int4" and nb["max_context"] > 0
    assert any("int4" in r for r in nb["not_built"])
    for o in plan["options"]:
        layout = (o["prefill"]["cp"] > 1, o["decode"]["dcp"] > 1)
        assert [any("context-parallel" in r for r in o["not_built"]),
                any("decode context" in r for r in o["not_built"])] == list(layout)
    # 8 x 141 GiB (H200): the engine's own layout holds it, so there is no better row that is not built to show.
    big = make_plan(d, Hardware(8, 141 * GIB), concurrency=1)
    assert big["plan"]["weight_format"] == "fp8" and big["plan"]["capacity_tokens"] > 0
    assert big["plan"]["not_built"] == [] and big["plan"]["max_context"] == 163840 and big["not_built"] is None


@pytest.mark.parametrize("memory, concurrency, target", [(141, 1, None), (141, 16, None), (141, 4, 131072)])
def test_plan_is_self_consistent(memory, concurrency, target):
    # The engine's KV sizing profiles the worst steps at max_model_len (a chunk reading the whole context, a decode
    # batch); at the planned context and concurrency those, the weights and every sequence's KV fit the device.
    d = ModelDims.from_path(CONFIGS / "deepseek_v32.json")
    hw = Hardware(8, memory * GIB)
    p = make_plan(d, hw, concurrency=concurrency, max_context=target)["plan"]
    budget = hw.device_memory * (1 - hw.margin) - hw.reserve - p["weights_gib"] * GIB

    def used(context, seqs):
        peak = worst_step_activation_bytes(d, 8192, seqs, context, 8, 8)["peak"]
        return peak + seqs * context * p["kv_token_bytes"]

    context, seqs = (target, p["max_concurrency"]) if target else (p["max_context"], concurrency)
    assert context > 8192 and seqs >= concurrency and used(context, seqs) <= budget
    planned_step = worst_step_activation_bytes(d, 8192, concurrency, context, 8, 8)["peak"]
    assert abs(p["activation_gib"] * GIB - planned_step) < 1  # the row's activation is that step at that context
    if target:
        assert used(context, seqs + 1) > budget  # and it is the most sequences that fit
    elif context < d.max_positions:
        assert used(context + 1, seqs) > budget  # the longest context that fits


def test_glm5_on_48gib_says_it_does_not_fit():
    plan = make_plan(ModelDims.from_path(CONFIGS / "glm5.json"), Hardware(8, 48 * GIB))
    assert plan["plan"]["capacity_tokens"] == 0 and "does not fit" in plan["plan"]["reasons"]["prefill"]


def test_cli_table_and_json(capsys):
    args = ["plan", "--model", str(CONFIGS / "deepseek_v32.json"), "--devices", "8", "--device-memory", "48GiB",
            "--interconnect", "pcie", "--concurrency", "16"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "| plan |" in text and "| not built |" in text and "not built (int4 weights" in text
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["not_built"]["max_context"] > out["plan"]["max_context"] >= out["baseline"]["max_context"]
    assert main(["plan", "--model", "missing.json"]) == 2


@pytest.mark.parametrize("text, value", [("48GiB", 48 * GIB), ("80 GB", 80 * 10**9), ("1.5gib", int(1.5 * GIB))])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_refuses_garbage():
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("48XB")
