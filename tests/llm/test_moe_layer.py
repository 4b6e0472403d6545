"""The MoE layer's stacked experts: views of one stack (names and memory unchanged), same output as the per-expert
loop, re-stacked after a move, and the loop again when a weight is replaced."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from metainfer_gen.kernels import audit, moe_runs_cpu
from metainfer_gen.kernels.moe import moe_experts_loop
from metainfer_gen.llm.layers.moe import MoE, pack_moe_experts

CONFIG = SimpleNamespace(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True,
                         routed_scaling_factor=2.5, hidden_size=64, moe_intermediate_size=32, n_shared_experts=1)


def _layer(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(CONFIG)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.1)
    return layer.eval()


def _loop_forward(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = layer.gate(x)
    routed = moe_experts_loop(x, weights, ids, layer.first_expert, list(layer.experts.values()))
    return routed + layer.shared_experts(x)


def _paths(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, set[str]]:
    with audit() as report:
        out = layer(x)
    return out, {e.path for e in report.entries if e.op == "moe_experts"}


def test_packing_keeps_names_values_and_storage():
    layer = _layer()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    assert pack_moe_experts(nn.Sequential(layer)) == 1
    after = layer.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    w13, w2 = layer._stacked
    assert layer.experts["0"].gate_proj.weight.data_ptr() == w13.data_ptr()
    assert layer.experts["7"].down_proj.weight.data_ptr() == w2[7].data_ptr()
    assert layer.experts["3"].up_proj.weight.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()


def test_stacked_forward_equals_the_per_expert_loop():
    layer = _layer(1)
    x = torch.randn(70, CONFIG.hidden_size)
    expected = _loop_forward(layer, x)
    layer.pack_experts()
    out, paths = _paths(layer, x)
    assert paths == {"grouped" if layer._cpp_refusal else "cpp"}  # the C++ experts where they build
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    many = torch.randn(300, CONFIG.hidden_size)  # 600 pairs: past the decode kernel's 32 an expert
    out, paths = _paths(layer, many)
    assert paths == {"cpp-runs" if moe_runs_cpu.warm_up() is None else "grouped"}  # the prefill-sized C++ runs
    torch.testing.assert_close(out, _loop_forward(layer, many), atol=1e-5, rtol=1e-5)


def test_move_restacks_and_a_replaced_weight_falls_back_to_the_loop():
    layer = _layer(2)
    layer.pack_experts()
    layer.double()
    x = torch.randn(9, CONFIG.hidden_size, dtype=torch.float64)
    out, paths = _paths(layer, x)
    assert paths == {"grouped"} and layer._stacked[0].dtype == torch.float64
    torch.testing.assert_close(out, _loop_forward(layer, x))
    layer.experts["0"].gate_proj.weight = nn.Parameter(torch.randn(32, 64, dtype=torch.float64))
    out, paths = _paths(layer, x)
    assert paths == set()  # the stale stack is not used
    torch.testing.assert_close(out, _loop_forward(layer, x))


def test_fp8_experts_are_not_stacked():
    layer = _layer(3)
    layer.experts["2"].up_proj.weight = nn.Parameter(layer.experts["2"].up_proj.weight.to(torch.float8_e4m3fn),
                                                     requires_grad=False)
    assert layer.pack_experts() is False and layer._stacked is None
