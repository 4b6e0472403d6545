"""Routed experts of a mixture-of-experts layer: tokens sorted by expert once, then batched or per-run GEMMs.

    out[t] = sum over slots j with e = ids[t, j] held here of  weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))

The experts this process holds are ``first_expert .. first_expert + E_local - 1`` (expert parallelism splits them
into contiguous ranges), stacked as ``w13`` (E_local, 2I, H), gate rows then up rows, and ``w2`` (E_local, H, I);
pairs routed to other ranks' experts contribute nothing here.

``grouped`` (the fast path, any device and float dtype): one stable ``argsort`` of the flattened top-k ids puts
each expert's (token, slot) pairs in a contiguous run, and one ``bincount`` with one host read of its counts (per
call, never per expert: no ``nonzero`` or boolean masks) gives the runs. Then either

- *padded*: few pairs and balanced runs (at most :data:`PADDED_MAX_PAIRS` pairs, and the padded batch no more than
  :data:`PADDED_MAX_WASTE` times the pairs): the runs are copied into an (E_local, longest run, H) batch, every
  expert runs in two ``torch.bmm`` over the stacked weights, and one ``index_add_`` sums the weighted rows into
  their tokens (decode steps: no Python loop over experts);
- *runs*: otherwise, per expert with tokens, a gather of its run, one gate-up GEMM, one down GEMM and a weighted
  ``index_add_`` (prefill chunks, skewed routing, idle experts). Each run stays in cache from gather to scatter:
  gathering every run first and scattering once was 1.2x slower at 8K pairs of width 384 on a CPU.

Outputs are weighted in float32 (the router's dtype) and rounded to ``x.dtype`` before the sum, as the reference
does. This is the token-sorting half of vLLM's ``moe_align_block_size`` + grouped GEMM, without a fused kernel.
Thresholds from this project's 2-core CPU (float32, one thread, load 2.5): padded beat per-run GEMMs 1.5-1.7x at
32-128 pairs (8 experts, hidden 128, width 96) and 1.1x at 512, and lost 1.9x at 2,048; with 16 experts of width
192 it tied up to 256 pairs and lost 1.2x at 1,024. A GPU, where each expert's run costs kernel launches, would
favour the padded batch further; the thresholds are not tuned there.

``cpp`` (CPU, float32 or bf16 with AVX512-BF16, decode-sized batches; :mod:`metainfer_gen.kernels.moe_cpu`) runs
before ``grouped``: the same sort in C++, then every active expert's weights streamed once through register tiles,
with no BLAS call per expert.

``cpp-runs`` (CPU, float32 or bf16, prefill-sized batches; :mod:`metainfer_gen.kernels.moe_runs_cpu`) runs between
the two: the sort and the per-expert loop of *runs* in C++, each expert's GEMMs torch's own, the gather, ``silu *
up`` and the weighted sum each one pass, with the grouped path's roundings.

``torch`` (the reference, always applicable): the engine's earlier loop, one gather, three linears and one
``index_add_`` per expert that received tokens. :func:`moe_experts_loop` is that loop over any per-expert callables
(the MoE layer uses it when its experts cannot be stacked, e.g. fp8 weights).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from metainfer_gen.kernels.gemm import bucketed_supports, bucket_rows, linear_bucketed
from metainfer_gen.kernels.moe_cpu import moe_experts_cpp, moe_experts_cpp_supports
from metainfer_gen.kernels.moe_runs_cpu import moe_experts_runs_cpp, moe_experts_runs_cpp_supports
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["PADDED_MAX_PAIRS", "PADDED_MAX_WASTE", "moe_experts", "moe_experts_grouped", "moe_experts_loop",
           "moe_experts_reference"]

# The padded batch pays for its empty rows and for bmm's poor blocking of long runs; the per-run loop pays a few
# small ops per expert (about 30 us each on a CPU).
PADDED_MAX_PAIRS = 512
PADDED_MAX_WASTE = 2.0


def moe_experts_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first_expert: int,
                     experts: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """The reference loop: ``experts[i]`` maps rows (n, H) -> (n, H) for global expert ``first_expert + i``.

    Returns (T, H) in ``x.dtype``; see the module docstring for the sum it computes.
    """
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=first_expert + len(experts)).tolist()
    token_of = order // ids.shape[1]
    weight_of = weights.flatten()[order]
    start = sum(counts[:first_expert])
    for expert, count in zip(experts, counts[first_expert:first_expert + len(experts)]):
        end = start + count
        if count:
            tokens = token_of[start:end]
            y = expert(x[tokens]) * weight_of[start:end, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        start = end
    return out


def moe_experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """:func:`moe_experts_loop` over the stacked weights: gate, up and down as three linears per expert."""
    size = w2.shape[2]

    def expert(e: int) -> Callable[[torch.Tensor], torch.Tensor]:
        gate, up, down = w13[e, :size], w13[e, size:], w2[e]
        return lambda rows: F.linear(F.silu(F.linear(rows, gate)) * F.linear(rows, up), down)

    return moe_experts_loop(x, weights, ids, first_expert, [expert(e) for e in range(w13.shape[0])])


def moe_experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """Sort once, then a padded batched matmul or one GEMM pair per contiguous run (module docstring)."""
    num_local, size = w13.shape[0], w2.shape[2]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts_t = torch.bincount(flat, minlength=first_expert + num_local)
    counts = counts_t.tolist()  # the one host sync
    local = counts[first_expert:first_expert + num_local]
    start = sum(counts[:first_expert])
    num_pairs = sum(local)
    out = torch.zeros_like(x)
    if num_pairs == 0:
        return out
    pairs = order[start:start + num_pairs]  # (P,) flat (token, slot) indices grouped by expert
    tokens = pairs // ids.shape[1]
    scale = weights.flatten()[pairs, None]  # (P, 1)
    longest = max(local)
    gemm = linear_bucketed if bucketed_supports(x, w13) is None else F.linear
    if num_pairs <= PADDED_MAX_PAIRS and num_local * longest <= PADDED_MAX_WASTE * num_pairs:
        if gemm is linear_bucketed:  # one bmm shape per bucket, not per longest run (oneDNN builds per shape)
            longest = bucket_rows(longest)
        ys = _padded(x.index_select(0, tokens), flat[pairs] - first_expert,
                     counts_t[first_expert:first_expert + num_local], longest, w13, w2)
        return out.index_add_(0, tokens, _scaled(ys, scale, x.dtype))
    begin = 0
    for e, count in enumerate(local):
        if count:
            run = slice(begin, begin + count)
            h = gemm(x.index_select(0, tokens[run]), w13[e])  # (n, 2I)
            y = gemm(F.silu(h[:, :size]) * h[:, size:], w2[e])
            out.index_add_(0, tokens[run], _scaled(y, scale[run], x.dtype))
        begin += count
    return out


def _scaled(y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y * scale`` rounded to ``dtype`` (in place when y already has the scale's dtype)."""
    return y.mul_(scale) if y.dtype == scale.dtype else (y * scale).to(dtype)


def _padded(rows: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, longest: int, w13: torch.Tensor,
            w2: torch.Tensor) -> torch.Tensor:
    """rows (P, H) sorted by local expert ``experts`` (P,) -> expert outputs (P, H) through an
    (E_local, longest, H) batch: row i goes to slot ``i - first row of its expert`` of its expert's block."""
    num_local, size = w13.shape[0], w2.shape[2]
    firsts = counts.cumsum(0) - counts
    slot = torch.arange(rows.shape[0], device=rows.device) - firsts[experts] + experts * longest
    batch = rows.new_zeros(num_local * longest, rows.shape[1]).index_copy_(0, slot, rows)
    h = torch.bmm(batch.view(num_local, longest, -1), w13.transpose(1, 2))  # (E, longest, 2I)
    y = torch.bmm(F.silu(h[..., :size]) * h[..., size:], w2.transpose(1, 2))  # (E, longest, H)
    return y.view(num_local * longest, -1).index_select(0, slot)


# --- registration and public API -------------------------------------------------------------------------------

def _example(device: str, dtype: torch.dtype):
    # A decode step of 64 tokens on the embedded LLM's MoE (8 experts, top-2, hidden 128, expert width 96).
    g = torch.Generator().manual_seed(0)
    ids = torch.rand(64, 8, generator=g).argsort(-1)[:, :2].to(device)
    weights = torch.rand(64, 2, generator=g).to(device)
    x = torch.randn(64, 128, generator=g).to(device, dtype)
    w13 = torch.randn(8, 192, 128, generator=g).to(device, dtype)
    w2 = torch.randn(8, 128, 96, generator=g).to(device, dtype)
    return (x, weights, ids, w13, w2, 0), {}


MOE_EXPERTS = register_op(Op("moe_experts", "routed MoE experts: sort by expert, grouped GEMMs", _example))
MOE_EXPERTS.register("cpp", moe_experts_cpp, moe_experts_cpp_supports, devices=("cpu",),
                     description="C++ fp32 / bf16 (vdpbf16ps): per expert, token x weight-row register tiles")
MOE_EXPERTS.register("cpp-runs", moe_experts_runs_cpp, moe_experts_runs_cpp_supports, devices=("cpu",),
                     description="C++ sort, one GEMM pair per active expert, fused silu x up and weighted sums")
MOE_EXPERTS.register("grouped", moe_experts_grouped,
                     description="one argsort + bincount, padded bmm or GEMMs per contiguous run")
MOE_EXPERTS.register("torch", moe_experts_reference, description="eager loop, three linears per expert")


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                first_expert: int = 0, *, site: str | None = None, strict: bool | None = None) -> torch.Tensor:
    """The routed experts' weighted sum for every token, by the fastest implementation that applies.

    Args:
        x: (T, H) float tokens.
        weights: (T, k) routing weights (float32 from the router).
        ids: (T, k) int64 global expert ids, distinct per token.
        w13: (E_local, 2I, H) each local expert's gate rows then up rows, ``x.dtype``.
        w2: (E_local, H, I) each local expert's down projection, ``x.dtype``.
        first_expert: global id of ``w13[0]``; ids outside ``first_expert .. + E_local - 1`` are skipped.
        site, strict: audit call-site name and strict mode (see the registry).
    Returns:
        (T, H) in ``x.dtype`` (zeros for tokens with no local expert).
    Raises:
        ValueError: shapes that do not fit together.
    Tolerance against :func:`moe_experts_reference`: 1e-5 in float32 (gate and up are one GEMM here, and the
    padded path batches them, so blocking may round differently); rows are summed in the same order (by expert).
    """
    if x.ndim != 2 or ids.ndim != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"need x (T, H), weights and ids (T, k); got x {tuple(x.shape)}, weights "
                         f"{tuple(weights.shape)}, ids {tuple(ids.shape)}")
    if w13.ndim != 3 or w2.ndim != 3 or w13.shape[2] != x.shape[1] or \
            tuple(w2.shape) != (w13.shape[0], x.shape[1], w13.shape[1] // 2) or w13.shape[1] % 2:
        raise ValueError(f"need w13 (E, 2I, H) and w2 (E, H, I) with H={x.shape[1]}; got w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    return MOE_EXPERTS.dispatch(x, weights, ids, w13, w2, first_expert, site=site, strict=strict, stacklevel=2)
