"""The CPU's routed MoE experts for prefill-sized batches in C++ (``csrc/moe_runs.cpp``), float32 or bf16.

A stable counting sort groups each local expert's (token, slot) pairs; then per active expert, in ascending expert
order: its tokens' rows gathered into one buffer, gate and up in one GEMM, ``silu(gate) * up`` in one pass, the
down projection in one GEMM, and each row scaled by its routing weight, rounded to x's dtype and added to its
token's sum in that dtype (the roundings of the reference's and transformers' ``index_add_``). The GEMMs are
torch's own (``at::mm_out``: oneDNN in bf16, rows padded to :func:`metainfer_gen.kernels.gemm.bucket_rows` as the
eager linears pad them, MKL in float32); what moves to C++ is the work between them, which the ``grouped`` path
spends as about ten torch ops an expert in a Python loop.
It serves the batches the decode-sized kernel (:mod:`metainfer_gen.kernels.moe_cpu`) refuses: above
:func:`~metainfer_gen.kernels.moe_cpu.max_pairs_per_expert` pairs an expert on average, where BLAS blocking
wins over register tiles. Figures (``benchmarks/moe.py``) are in docs/kernels_cpu.md. Built once per machine by
:mod:`metainfer_gen.kernels.cpu_build`; where the build is off or fails the registry refuses it with the reason.
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.common import dtype_refusal, first_refusal
from metainfer_gen.kernels.cpu_build import ensure_built, load_built
from metainfer_gen.kernels.moe_cpu import max_pairs_per_expert, within_pairs_limit

__all__ = ["KERNEL", "moe_experts_runs_cpp", "moe_experts_runs_cpp_supports", "warm_up"]

KERNEL = "moe_runs"


def moe_experts_runs_cpp_supports(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                                  w2: torch.Tensor, first_expert: int = 0) -> str | None:
    """None when the C++ runs apply to these :func:`metainfer_gen.kernels.moe_experts` arguments (CPU tensors, x
    float32 or bf16 as the weights, contiguous weight stacks, float32 routing weights and int64 ids, a batch above
    the decode-sized kernel's limit, no autograd, the kernel built), else why not."""
    pairs, num_local = ids.numel(), w13.shape[0]
    return first_refusal(
        None if x.device.type == "cpu" and w13.device.type == "cpu" else
        f"x on {x.device}, experts on {w13.device}; the C++ kernel takes CPU tensors",
        dtype_refusal("x", x, (torch.float32, torch.bfloat16)),
        None if w13.dtype == w2.dtype == x.dtype else f"expert weights {w13.dtype} / {w2.dtype}, x {x.dtype}",
        None if w13.is_contiguous() and w2.is_contiguous() else "expert weights are not contiguous stacks",
        None if weights.dtype == torch.float32 and ids.dtype == torch.int64 else
        f"routing weights {weights.dtype} / ids {ids.dtype} (need float32 / int64)",
        None if not within_pairs_limit(pairs, num_local, x.dtype) else
        f"{pairs} pairs over {num_local} experts: decode-sized (at most {max_pairs_per_expert(x.dtype)} an expert in "
        f"{x.dtype}), where per-expert GEMMs pay more than they save",
        None if not (torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad)) else
        "autograd is on; the kernel has no backward",
    ) or load_built(KERNEL)[1]


def moe_experts_runs_cpp(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """Same arguments and result as :func:`metainfer_gen.kernels.moe_experts` ((T, H) in x's dtype); each token's
    pairs are summed in ascending expert order, each weighted output and partial sum rounded to x's dtype. Raises
    RuntimeError where the kernel is not built or the tensors break its contract (dtypes, contiguity, shapes)."""
    return ensure_built(KERNEL).moe_runs(x.contiguous(), weights.contiguous(), ids.contiguous(), w13, w2,
                                         int(first_expert), x.dtype != torch.float32)


def warm_up() -> str | None:
    """Build (or load) the kernel now, before the first request: None when ready, else the reason it is not."""
    return load_built(KERNEL)[1]
