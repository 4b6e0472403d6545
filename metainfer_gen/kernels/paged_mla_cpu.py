"""The CPU's paged MLA decode in C++ (``csrc/paged_mla_decode.cpp``): the absorbed query of each sequence scored in
place against its latent-cache blocks through the block table (no gathered copy of the context), one online softmax
per block, long contexts split into pieces merged by log-sum-exp, torch's threads taking pieces longest first.

Where the target has AVX512-BF16 (Zen 4/5, Sapphire Rapids and later) bf16 scores use its pairwise dot product;
values accumulate in float32 from rows widened in registers. Against ``torch-blocks`` (gather, ``bmm``, softmax,
``bmm``) at 64 sequences of 64-544 tokens, 8 heads, 576-wide rows, block size 16 on an Intel Xeon with AMX-BF16:
1.85x (bf16) and 2.39x (fp32) on one thread, 2.07x and 2.59x on two (``benchmarks/paged_mla_cpu.py``). Built once
per machine by :mod:`metainfer_gen.kernels.cpu_build`; where the build is off or fails the registry refuses it with
the reason.
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.common import dtype_refusal, first_refusal
from metainfer_gen.kernels.cpu_build import ensure_built, load_built

__all__ = ["KERNEL", "paged_mla_decode_cpp", "paged_mla_decode_cpp_supports", "warm_up"]

KERNEL = "paged_mla_decode"
_DTYPES = (torch.float32, torch.bfloat16)


def paged_mla_decode_cpp_supports(q, kv_rows, block_tables, context_lens, block_size, value_dim,
                                  scale) -> str | None:
    """None when the C++ kernel applies (CPU tensors, float32 or bfloat16 with the cache in q's dtype, unit column
    stride, Dk and value_dim multiples of 16, no autograd, the kernel built), else why not."""
    if q.device.type != "cpu" or kv_rows.device.type != "cpu":
        return f"tensors on {q.device}/{kv_rows.device}; the C++ kernel takes CPU tensors"
    reason = first_refusal(
        dtype_refusal("q", q, _DTYPES),
        None if kv_rows.dtype == q.dtype else f"cache dtype {kv_rows.dtype} differs from q's {q.dtype}",
        None if kv_rows.stride(-1) == 1 else f"cache rows are strided (stride {tuple(kv_rows.stride())})",
        None if q.shape[-1] % 16 == 0 and value_dim % 16 == 0 else
        f"Dk {q.shape[-1]} and value_dim {value_dim} must be multiples of 16",
        None if not (torch.is_grad_enabled() and q.requires_grad) else "q requires grad; the kernel has no backward",
    )
    return reason or load_built(KERNEL)[1]


def paged_mla_decode_cpp(q: torch.Tensor, kv_rows: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, block_size: int, value_dim: int, scale: float) -> torch.Tensor:
    """Same arguments and result as :func:`metainfer_gen.kernels.paged_mla.paged_mla_decode` ((B, N, r) in q's
    dtype); only the blocks inside each context are read, so table entries past them may be anything. Raises
    RuntimeError for a context length outside [1, W * block_size] or a block id outside the cache."""
    return ensure_built(KERNEL).paged_mla_decode(q.contiguous(), kv_rows, block_tables.contiguous(), context_lens,
                                                 block_size, value_dim, float(scale))


def warm_up() -> str | None:
    """Build (or load) the kernel now, before the first request: None when ready, else the reason it is not."""
    return load_built(KERNEL)[1]
