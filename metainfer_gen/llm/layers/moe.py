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

Routed experts run through :func:`metainfer_gen.kernels.moe_experts` (tokens sorted by expert once, then a padded
``bmm`` or GEMMs per contiguous run; the per-expert reference loop stays registered), which needs each rank's
expert weights stacked: the loader allocates the stacks first (:meth:`MoE.stack_empty_experts`) and reads every
expert's weights into its views, so the experts are never held twice; :func:`pack_moe_experts` stacks experts
that already have their own storage. Either way every expert's ``weight`` is a view of the stack, so names and
checkpoints stay as they were. Experts that cannot be stacked (fp8 block-scaled weights, which stay fp8) run the
reference loop over their modules, each through the fp8 block GEMM.

While a CUDA graph is being captured (``llm/static_decode.py``), stacked experts run :func:`moe_experts_dense`
instead: the sorted path reads the per-expert counts on the host, which a graph cannot replay. A compiled CPU decode
step (``llm/compiled_decode.py``) calls the routed experts as an opaque op where the C++ kernel applies (float32 on
the CPU: each active expert read once, :mod:`metainfer_gen.kernels.moe_cpu`); elsewhere it traces
:func:`moe_experts_folded` (every expert, two GEMMs in the graph) where E_local <= ``DENSE_IN_GRAPH_MAX_RATIO`` x
top-k, and calls the sorted path as an opaque op otherwise (always in a compiled prefill step, whose token count is
symbolic). On 2 Zen 3 cores the folded GEMMs of a 16-token decode
step took 2.2 ms a layer (16 experts of width 192, all multiplied for every token), the C++ kernel 0.44 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metainfer_gen.kernels.moe import moe_experts_loop
from metainfer_gen.kernels.moe_cpu import moe_weights_cpp_refusal, within_pairs_limit
from metainfer_gen.llm import graph_ops
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


_SITE = "llm.MoE.experts"


def _routing_matrix(weights: torch.Tensor, ids: torch.Tensor, num_local: int, first_expert: int) -> torch.Tensor:
    """(T, E_local) float32: each token's routing weight at its local experts' columns, zero elsewhere."""
    local = ids - first_expert
    held = (local >= 0) & (local < num_local)
    combine = torch.zeros(ids.shape[0], num_local, dtype=torch.float32, device=ids.device)
    return combine.scatter_add_(1, local.clamp(0, num_local - 1), torch.where(held, weights.float(), 0))


def moe_experts_dense(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """Every local expert on every token, summed through a (T, E_local) routing matrix that is zero off the top-k:
    no host sync and static shapes, so a CUDA graph can hold it. x (T, H), weights/ids (T, k), w13 (E, 2I, H),
    w2 (E, H, I) -> (T, H). Costs E_local / k times the routed FLOPs and reads every local expert once (a decode
    batch with T * k >= E_local reads them all anyway); meant for the small batches of captured decode steps."""
    size = w2.shape[2]
    combine = _routing_matrix(weights, ids, w13.shape[0], first_expert)
    h = torch.matmul(x, w13.transpose(1, 2))  # (E, T, 2I)
    y = torch.bmm(F.silu(h[..., :size]) * h[..., size:], w2.transpose(1, 2))  # (E, T, H)
    return (y.float() * combine.t()[..., None]).sum(0).to(x.dtype)


def moe_experts_folded(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """:func:`moe_experts_dense` as two GEMMs, for a compiled decode graph (where a frozen compile prepacks both).

    ``h = x @ [W13_0; ...; W13_E].T`` (T, E * 2I), ``a_e = silu(gate_e) * up_e * combine[:, e]``, then one GEMM of
    ``[a_0 ... a_E]`` (T, E * I) with the experts' down projections side by side (H, E * I): the down projection is
    linear, so scaling its input by the routing weight equals scaling its output. Same arguments and result. The
    side-by-side down weight is a copy: a frozen compile folds it into a constant once (eagerly it would be copied
    on every call)."""
    num_local, size, hidden = w13.shape[0], w2.shape[2], x.shape[1]
    combine = _routing_matrix(weights, ids, num_local, first_expert)
    h = F.linear(x, w13.reshape(num_local * 2 * size, hidden)).view(-1, num_local, 2 * size)
    act = (F.silu(h[..., :size]) * h[..., size:]).float() * combine[..., None]  # (T, E, I)
    down = w2.permute(1, 0, 2).reshape(hidden, num_local * size)
    return F.linear(act.to(x.dtype).reshape(-1, num_local * size), down)


DENSE_IN_GRAPH_MAX_RATIO = 4  # a compiled decode step runs every expert when E_local <= this * top_k


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class MoE(nn.Module):
    """Routed experts + shared experts; ``forward`` (T, hidden) -> (T, hidden).

    ``experts`` is a ``ModuleDict`` keyed by the global expert id (``"0"``, ``"1"``, ...), so parameter names match
    the checkpoint's ``mlp.experts.N.*`` and a rank holds only its own experts (ids ``first_expert`` onwards).
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
        local = local_experts(config.n_routed_experts, tp)
        self.first_expert = local[0]
        self.experts = nn.ModuleDict({str(e): MLP(config.hidden_size, config.moe_intermediate_size) for e in local})
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, tp=tp,
                                  reduce=False)
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (w13, w2), see pack_experts
        self._cpp_refusal: str | None = "experts not stacked"  # why the C++ experts cannot run over the stack

    @torch.no_grad()
    def pack_experts(self) -> bool:
        """Stack the local experts into ``w13`` (E_local, 2I, H) (gate rows, then up rows) and ``w2``
        (E_local, H, I), and make each expert's ``weight`` parameters views of them (no second copy).

        Call again after replacing expert weights; moving the module (``.to()``) re-packs by itself. Returns False,
        leaving the experts unstacked (reference loop), when a weight is not a dense float tensor (fp8) or is on
        the meta device.
        """
        mlps = list(self.experts.values())
        layers = [(m.gate_proj, m.up_proj, m.down_proj) for m in mlps]
        if any(not lin.weight.is_floating_point() or lin.weight.element_size() < 2 or lin.weight.is_meta
               for trio in layers for lin in trio):
            self._stacked = None
            return False
        self._view_stack(*self._stack_parameters())
        return True

    def _stack_parameters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """New ``w13`` (E_local, 2I, H) and ``w2`` (E_local, H, I) stacked from the experts' parameters (under a
        frozen compile: constants folded once, at compile time)."""
        layers = [(m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight) for m in self.experts.values()]
        return torch.stack([torch.cat([g, u]) for g, u, _ in layers]), torch.stack([d for _, _, d in layers])

    def stack_empty_experts(self, dtype: torch.dtype, device: torch.device) -> None:
        """Give the local experts uninitialised stacked storage, ``w13`` (E_local, 2I, H) and ``w2``
        (E_local, H, I) in ``dtype`` on ``device``, every expert ``weight`` a view of it (what
        :meth:`pack_experts` leaves, without a copy): the loader then fills the views in place."""
        mlp = self.experts[str(self.first_expert)]
        size, hidden = mlp.gate_proj.weight.shape
        num = len(self.experts)
        self._view_stack(torch.empty(num, 2 * size, hidden, dtype=dtype, device=device),
                         torch.empty(num, hidden, size, dtype=dtype, device=device))

    def _view_stack(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        size = w2.shape[2]
        for e, mlp in enumerate(self.experts.values()):
            for lin, view in ((mlp.gate_proj, w13[e, :size]), (mlp.up_proj, w13[e, size:]), (mlp.down_proj, w2[e])):
                lin.weight = nn.Parameter(view, requires_grad=False)
        self._stacked = (w13, w2)
        self._cpp_refusal = moe_weights_cpp_refusal(w13, w2)

    def unpack_experts(self) -> None:
        """Run the per-expert reference loop again (the weights stay views of the stack; ``pack_experts`` undoes
        this)."""
        self._stacked = None

    def _apply(self, fn, recurse=True):
        # .to()/.half() give every parameter its own storage: stack again so the views and the stack stay one.
        module = super()._apply(fn, recurse)
        if self._stacked is not None:
            self.pack_experts()
        return module

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stack, if the first and last experts still view it (a replaced weight turns stacking off)."""
        if self._stacked is None:
            return None
        w13, w2 = self._stacked
        first, last = self.experts[str(self.first_expert)], self.experts[str(self.first_expert + len(w2) - 1)]
        if first.gate_proj.weight.data_ptr() != w13.data_ptr() or last.down_proj.weight.data_ptr() != w2[-1].data_ptr():
            return None
        return w13, w2

    def _cpp_in_graph(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether a traced step should call the C++ experts (as an opaque op) rather than fold every expert into
        the graph: decided from shapes, dtypes and the stack's refusal taken when it was built (no call a trace
        would break on)."""
        return self._cpp_refusal is None and x.dtype == self._stacked[0].dtype and \
            within_pairs_limit(ids.numel(), len(self._stacked[0]), x.dtype, in_graph=True)

    def forward(self, x: torch.Tensor, opaque: bool = False) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); ``opaque``: a traced step calls the stacked experts as the opaque op whatever
        its size (a compiled prefill graph, whose token count is symbolic: no choice may read it)."""
        weights, ids = self.gate(x)  # (T, k) float32, (T, k) int64
        compiling = torch.compiler.is_compiling()
        stacked = self._stacked if compiling else self._stacked_weights()
        if stacked is not None and compiling and not opaque \
                and len(stacked[1]) <= DENSE_IN_GRAPH_MAX_RATIO * self.gate.top_k and not self._cpp_in_graph(x, ids):
            # traced from the parameters, which a frozen graph holds as constants (the stack is a plain attribute)
            out = moe_experts_folded(x, weights, ids, *self._stack_parameters(), self.first_expert)
        elif stacked is not None and _capturing(x):
            out = moe_experts_dense(x, weights, ids, *stacked, self.first_expert)
        elif stacked is not None:
            out = graph_ops.moe_experts(x, weights, ids, *stacked, self.first_expert, _SITE)
        else:
            out = moe_experts_loop(x, weights, ids, self.first_expert, list(self.experts.values()))
        return self.tp.all_reduce(out + self.shared_experts(x))


def pack_moe_experts(model: nn.Module) -> int:
    """:meth:`MoE.pack_experts` on every MoE layer of ``model``; returns how many were stacked."""
    return sum(module.pack_experts() for module in model.modules() if isinstance(module, MoE))
