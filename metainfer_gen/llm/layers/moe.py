"""DeepSeek-V3 feed-forward layers: the dense SwiGLU MLP and the mixture of experts with grouped top-k routing.

Routing (DeepSeek-V3 report, arXiv:2412.19437, section 2.1.2; transformers ``DeepseekV3TopkRouter``): sigmoid
affinities plus a load-balancing bias choose experts, but only within the ``topk_group`` best of ``n_group``
groups (a group's score is the sum of its two best biased affinities); the chosen experts are weighted by their
*unbiased* affinities, normalised when ``norm_topk_prob``, times ``routed_scaling_factor``. Shared experts run on
every token. Experts are one ``nn.Module`` each, named as checkpoints store them (``experts.N.gate_proj``).

Tensor parallelism: the dense MLP and the shared experts split their intermediate dimension (gate/up
column-parallel, down row-parallel); the routed experts are split whole across ranks (expert parallelism: rank
``r`` of ``s`` holds experts ``e`` with ``e * s // E == r``, contiguous ranges), the router is replicated, and one
all-reduce sums the routed and shared partial outputs of a MoE layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metainfer_gen.llm.layers.linear import ColumnParallelLinear, RowParallelLinear
from metainfer_gen.llm.parallel import TensorParallel


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; (T, hidden) -> (T, hidden).

    Args:
        tp: split the intermediate dimension over this group (None: one process).
        reduce: sum the down projection over the group (False: return this rank's partial sum).
    Raises:
        ValueError: ``intermediate_size`` not divisible by the tensor-parallel size.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel | None = None,
                 reduce: bool = True):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp=tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    """Grouped top-k gate; parameters ``weight`` (E, hidden) and ``e_score_correction_bias`` (E,), float32."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts={self.num_experts} must be divisible by n_group={self.num_groups}")
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, k) float32, expert ids (T, k) int64)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias
        grouped = biased.view(-1, self.num_groups, self.num_experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # (T, n_group)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
        ids = biased.masked_fill(~expert_mask, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


def local_experts(num_experts: int, tp: TensorParallel) -> list[int]:
    """The routed experts rank ``tp.rank`` holds: a contiguous range, sizes differing by at most one."""
    return [e for e in range(num_experts) if e * tp.size // num_experts == tp.rank]


class MoE(nn.Module):
    """Routed experts + shared experts; ``forward`` (T, hidden) -> (T, hidden).

    ``experts`` is a ``ModuleDict`` keyed by the global expert id (``"0"``, ``"1"``, ...), so parameter names match
    the checkpoint's ``mlp.experts.N.*`` and a rank holds only its own experts.
    Raises:
        ValueError: fewer routed experts than ranks, or shared-expert width not divisible by the size.
    """

    def __init__(self, config, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp = tp or TensorParallel.single()
        if config.n_routed_experts < tp.size:
            raise ValueError(f"n_routed_experts={config.n_routed_experts} is below tensor_parallel_size={tp.size}: "
                             f"some ranks would hold no expert")
        self.gate = TopKRouter(config)
        self.experts = nn.ModuleDict({str(e): MLP(config.hidden_size, config.moe_intermediate_size)
                                      for e in local_experts(config.n_routed_experts, tp)})
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, tp=tp,
                                  reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        # Group the (token, slot) pairs by expert with one sort, then one matmul chain per local expert that
        # received tokens (a grouped GEMM on GPU is the FP8 issue's business).
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate.num_experts).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.flatten()[order]
        start = 0
        for expert_id, count in enumerate(counts):
            end = start + count
            if count and str(expert_id) in self.experts:  # others are held by other ranks
                tokens = token_of[start:end]
                y = self.experts[str(expert_id)](x[tokens]) * weight_of[start:end, None]
                out.index_add_(0, tokens, y.to(x.dtype))
            start = end
        return self.tp.all_reduce(out + self.shared_experts(x))
