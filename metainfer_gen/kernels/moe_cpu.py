"""The CPU's routed MoE experts in C++ (``csrc/moe_experts.cpp``) for decode-sized batches, float32 or bf16.

A counting sort groups each local expert's (token, slot) pairs; then, per expert and block of 32 weight rows, a
register tile of token rows x weight rows accumulates dot products over the hidden dimension, reading the stacked
``w13`` / ``w2`` in place (their checkpoint layout: no copy, no packing). Each active expert's weights are streamed
once per call however few tokens it got, and both threads of torch's pool take (expert, row block) items from one
counter. The per-expert BLAS calls of the ``grouped`` path pay packing and threading for a handful of rows, and a
compiled decode graph's every-expert GEMMs read and multiply all experts for every token.

Where it applies: CPU tensors; float32, or bf16 where the build targets AVX512-BF16 (``vdpbf16ps``: AVX512-BF16
and AMX CPUs; elsewhere bf16 runs oneDNN's GEMMs); hidden and expert widths multiples of 16 (32 in bf16); at most
:func:`max_pairs_per_expert` pairs per local expert on average (64 in bf16, 32 in float32): past that BLAS blocking
wins (prefill chunks). Figures (``benchmarks/moe.py``) are in docs/kernels_cpu.md. Built once per machine by
:mod:`metainfer_gen.kernels.cpu_build`; where the build is off or fails the registry refuses it with the reason.
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.common import dtype_refusal, first_refusal
from metainfer_gen.kernels.cpu_build import ensure_built, load_built

__all__ = ["CPP_BF16_IN_GRAPH_MAX_PAIRS_PER_EXPERT", "CPP_FP32_MAX_PAIRS_PER_EXPERT", "CPP_MAX_PAIRS_PER_EXPERT",
           "KERNEL", "max_pairs_per_expert", "moe_experts_cpp", "moe_experts_cpp_supports", "moe_weights_cpp_refusal",
           "warm_up", "within_pairs_limit"]

KERNEL = "moe_experts"
# On 2 Zen 3 cores (float32, 16 experts of width 192, hidden 384, top-4, weights in cache) the kernel ran 4.7-7.6x
# the grouped path at 1-4 tokens, 2.5x at 16, 1.6x at 64, 1.1x at 256 (64 pairs an expert) and 0.44x at 2,048 (512).
# Against the ``cpp-runs`` path (one MKL / oneDNN GEMM pair per active expert) on 2 Zen 4 cores (same shapes, 8 layers
# of weights, benchmarks/moe_crossover.py): bf16 (vdpbf16ps) still won 1.18x at 64 pairs an expert and tied near 100
# (kept at 64: it sums a token's pairs in float32, where transformers rounds per pair); float32 tied at 32 and took
# 1.14x / 1.28x longer at 48 / 64, where one prompt's prefill of 200-256 tokens lands.
CPP_MAX_PAIRS_PER_EXPERT = 64
CPP_FP32_MAX_PAIRS_PER_EXPERT = 32
# In a compiled bf16 decode step the alternative is not the grouped path but oneDNN's every-expert GEMMs folded into
# the graph: they read the same weights at a higher rate and their extra multiplies are cheap at decode widths. On
# 2 Zen 4 cores (AVX512-BF16, random-large, benchmarks/llm_decode_step.py --baseline folded-experts) the kernel's
# step was 1.15x the folded one at batch 1 (0.25 pairs an expert), 0.87x at 16 (4) and 1.00x at 64 (16).
CPP_BF16_IN_GRAPH_MAX_PAIRS_PER_EXPERT = 1


def moe_weights_cpp_refusal(w13: torch.Tensor, w2: torch.Tensor) -> str | None:
    """None when the C++ kernel can run over these expert stacks (CPU, float32 or bf16 with AVX512-BF16 in the
    build, contiguous, widths multiples of 16 (32 in bf16), the kernel built: building it on the first call on this
    machine), else why not. Depends on the weights only, so a layer can ask once, outside a traced graph."""
    if w13.device.type != "cpu" or w2.device.type != "cpu":
        return f"expert weights on {w13.device}; the C++ kernel takes CPU tensors"
    width = 32 if w13.dtype == torch.bfloat16 else 16
    reason = first_refusal(
        dtype_refusal("expert weights", w13, (torch.float32, torch.bfloat16)),
        None if w2.dtype == w13.dtype else f"w2 dtype {w2.dtype} differs from w13's {w13.dtype}",
        None if w13.is_contiguous() and w2.is_contiguous() else "expert weights are not contiguous stacks",
        None if w13.shape[2] % width == 0 and w2.shape[2] % width == 0 else
        f"hidden {w13.shape[2]} and expert width {w2.shape[2]} must be multiples of {width} in {w13.dtype}",
    )
    if reason:
        return reason
    module, reason = load_built(KERNEL)
    if reason is None and w13.dtype == torch.bfloat16 and not module.avx512_bf16:
        return ("bf16 experts need AVX512-BF16 (vdpbf16ps) in the build, which this CPU lacks; oneDNN's bf16 "
                "GEMMs run them")
    return reason


def max_pairs_per_expert(dtype: torch.dtype, in_graph: bool = False) -> int:
    """The most (token, slot) pairs per local expert, on average, for which the kernel runs on ``dtype`` inputs:
    eagerly, where the ``cpp-runs`` GEMMs take the larger batches; ``in_graph``, inside a compiled decode step,
    where the alternative is the step's folded every-expert GEMMs."""
    if in_graph:
        return CPP_BF16_IN_GRAPH_MAX_PAIRS_PER_EXPERT if dtype == torch.bfloat16 else CPP_MAX_PAIRS_PER_EXPERT
    return CPP_FP32_MAX_PAIRS_PER_EXPERT if dtype == torch.float32 else CPP_MAX_PAIRS_PER_EXPERT


def within_pairs_limit(num_pairs: int, num_local: int, dtype: torch.dtype, in_graph: bool = False) -> bool:
    """Whether ``num_pairs`` (token, slot) pairs over ``num_local`` experts are few enough for the kernel
    (:func:`max_pairs_per_expert`)."""
    return num_pairs <= max_pairs_per_expert(dtype, in_graph) * num_local


def moe_experts_cpp_supports(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                             w2: torch.Tensor, first_expert: int = 0) -> str | None:
    """None when the C++ kernel applies to these :func:`metainfer_gen.kernels.moe_experts` arguments, else why
    not (device, dtype, layout, widths, batch size, or the build's own refusal)."""
    pairs, num_local = ids.numel(), w13.shape[0]
    return first_refusal(
        None if x.device.type == "cpu" else f"x on {x.device}; the C++ kernel takes CPU tensors",
        dtype_refusal("x", x, (w13.dtype,)),
        None if weights.dtype == torch.float32 and ids.dtype == torch.int64 else
        f"routing weights {weights.dtype} / ids {ids.dtype} (need float32 / int64)",
        None if within_pairs_limit(pairs, num_local, x.dtype) else
        f"{pairs} pairs over {num_local} experts: above {max_pairs_per_expert(x.dtype)} an expert in {x.dtype}, "
        f"BLAS GEMMs win",
        None if not (torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad)) else
        "autograd is on; the kernel has no backward",
        moe_weights_cpp_refusal(w13, w2),
    )


def moe_experts_cpp(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    first_expert: int = 0) -> torch.Tensor:
    """Same arguments and result as :func:`metainfer_gen.kernels.moe_experts` ((T, H) in x's dtype, float32 or
    bf16); pairs are summed per token in float32 in ascending expert order, as the reference orders them.
    Raises RuntimeError where the kernel is not built or the tensors break its contract (dtype, contiguity, widths)."""
    return ensure_built(KERNEL).moe_experts(x.contiguous(), weights.contiguous(), ids.contiguous(), w13, w2,
                                            int(first_expert))


def warm_up() -> str | None:
    """Build (or load) the kernel now, before the first request: None when ready, else the reason it is not."""
    return load_built(KERNEL)[1]
