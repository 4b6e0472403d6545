"""DeepSeek-V4's MoE block, reference path: learned or hash routing, SwiGLU clamped at ``swiglu_limit``.

``moe`` layers pick the top ``num_experts_per_tok`` experts by ``score + e_score_correction_bias`` (scores from
``scoring_func``, V4's ``sqrtsoftplus``); ``hash_moe`` layers (the first ones) take them from a frozen token-id
table ``tid2eid`` instead. Either way the chosen experts' scores, normalised to sum 1 and times
``routed_scaling_factor``, weight their outputs, and one shared expert adds its own. Gate and up are clamped
(gate at most ``limit``, up within +-``limit``) before ``silu(gate) * up``.

Tensor parallelism (as DeepSeek-V3's :class:`~metainfer_gen.llm.layers.moe.MoE`): the routed experts are split
whole over the ranks (contiguous ranges, :func:`~metainfer_gen.llm.layers.moe.local_experts`), the shared expert's
intermediate columns are split (gate/up column-parallel, down row-parallel), the router (and its ``tid2eid`` hash
table) is replicated, and one all-reduce sums the routed and shared partial outputs.

The experts run one by one in plain torch (no grouped or FP8 GEMMs yet: ``kernels.moe_experts`` has no clamp);
experts are stored as transformers fuses them in memory (``experts.gate_up_proj`` (E, 2I, H),
``experts.down_proj`` (E, H, I)). Source: transformers 5.24 ``DeepseekV4SparseMoeBlock``, ``DeepseekV4TopKRouter``,
``DeepseekV4HashRouter``, ``DeepseekV4Experts``, ``DeepseekV4MLP`` (the correctness reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metainfer_gen.llm.layers.linear import ColumnParallelLinear, RowParallelLinear
from metainfer_gen.llm.layers.moe import local_experts
from metainfer_gen.llm.parallel import Shard, TensorParallel


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClampedMLP(nn.Module):
    """The shared expert: gate/up/down projections with the clamped SwiGLU; under ``tp`` the intermediate columns
    are split and ``down_proj`` returns this rank's partial sum (the caller reduces)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, tp: TensorParallel | None = None):
        super().__init__()
        self.limit = limit
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp=tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """Expert choice and weights: ``weight`` (E, H); ``tid2eid`` (vocab, k) on hash layers, else
    ``e_score_correction_bias`` (E,) float32."""

    def __init__(self, config, hashed: bool):
        super().__init__()
        from transformers.activations import ACT2FN

        self.top_k, self.scale, self.hashed = config.num_experts_per_tok, config.routed_scaling_factor, hashed
        self.score_fn = ACT2FN[config.scoring_func]
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H), input_ids (T,) -> (expert ids (T, k) int64, weights (T, k) in the scores' dtype)."""
        scores = self.score_fn(F.linear(x, self.weight))
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale


class Experts(nn.Module):
    """Routed experts, fused as transformers holds them: ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I);
    under ``tp`` this rank's experts ``first_expert`` .. ``first_expert + E_local - 1`` only (``tp_shard`` on
    dimension 0 says which), and tokens routed elsewhere contribute zero here."""

    def __init__(self, config, tp: TensorParallel | None = None):
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.intermediate_size
        local = local_experts(e, tp or TensorParallel.single())
        self.first_expert, self.num_local = local[0], len(local)
        self.limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(self.num_local, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(self.num_local, h, i))
        if self.num_local < e:
            for param in (self.gate_up_proj, self.down_proj):
                param.tp_shard = Shard(0, self.first_expert, self.num_local, e)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, H), ids / weights (T, k) from the router (global expert ids) -> (T, H) this rank's share."""
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            local = expert - self.first_expert
            if not 0 <= local < self.num_local:
                continue
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[local]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[local])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class V4MoE(nn.Module):
    """One V4 MLP block (every V4 layer is MoE); ``config`` a transformers ``DeepseekV4Config``; ``tp`` splits the
    experts and the shared expert's columns (the router is replicated).

    Raises:
        ValueError: an ``mlp_layer_types`` entry other than "moe" / "hash_moe"; a shared-expert width not
            divisible by the tensor-parallel size.
    """

    def __init__(self, config, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp or TensorParallel.single()
        kind = config.mlp_layer_types[layer_idx]
        if kind not in ("moe", "hash_moe"):
            raise ValueError(f"mlp_layer_types[{layer_idx}] = {kind!r}; DeepSeek-V4 layers are 'moe' or 'hash_moe'")
        self.gate = Router(config, hashed=kind == "hash_moe")
        self.experts = Experts(config, self.tp)
        self.shared_experts = ClampedMLP(config.hidden_size, config.intermediate_size, config.swiglu_limit, self.tp)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x (T, H), input_ids (T,) -> (T, H)."""
        ids, weights = self.gate(x, input_ids)
        return self.tp.all_reduce(self.experts(x, ids, weights) + self.shared_experts(x))
