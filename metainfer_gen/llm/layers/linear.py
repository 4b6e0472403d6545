"""Tensor-parallel linear layers with a weight loader per layer (nano-vllm ``layers/linear.py``, Megatron-LM).

- :class:`ColumnParallelLinear`: the output features are split; rank ``r`` holds rows ``[r*n:(r+1)*n]`` of the
  weight (out/size, in) and produces its slice of the output, no communication.
- :class:`RowParallelLinear`: the input features are split; rank ``r`` holds columns of the weight (out, in/size),
  multiplies its slice of the input, and the partial products are summed over the group (``reduce=False`` leaves
  the sum to the caller, which lets a MoE layer fold routed and shared experts into one all-reduce). The bias is
  added once, after the sum.

:class:`ReplicatedLinear` holds the whole weight on every rank (the MLA latent projections, the DSA indexer).

FP8: the loader (:mod:`metainfer_gen.llm.weight_fill`; :func:`metainfer_gen.llm.fp8.quantize_linear_fp8` for a
layer already in memory) gives ``weight`` float8_e4m3fn with a ``weight_scale_inv`` buffer of 128x128 block scales
(per shard, so a shard whose size is not a multiple of 128 gets its own partial last block); the layer then
multiplies through :func:`metainfer_gen.kernels.fp8_linear`.
Layers whose weight is read directly elsewhere set ``fp8_eligible = False`` (MLA's ``kv_b_proj``, used in the
absorbed form) and stay in the run dtype.

Each split parameter carries ``tp_shard``, a :class:`~metainfer_gen.llm.parallel.Shard` (which rows or columns of
the checkpoint's full tensor this rank holds; absent on replicated ones): :func:`metainfer_gen.llm.loader.load_model`
reads just that range from the safetensors file, so checkpoints stay in their one-process layout and no rank reads
the full tensor. With ``TensorParallel.single()`` both classes compute exactly what ``nn.Linear`` computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metainfer_gen.llm.parallel import Shard, TensorParallel

__all__ = ["ColumnParallelLinear", "LinearBase", "ReplicatedLinear", "RowParallelLinear", "configure_gemms"]


class LinearBase(nn.Module):
    """Weight (out, in) with its tensor-parallel ``tp_shard`` (None: whole); dense or fp8 block-scaled multiply.

    ``gemm`` is the dense multiply, ``F.linear`` until :func:`configure_gemms` picks the platform's path at load
    (:func:`metainfer_gen.kernels.gemm.select_linear`: rows padded to a bucket on oneDNN bf16)."""

    fp8_eligible = True
    gemm = staticmethod(F.linear)

    def __init__(self, weight_shape: tuple[int, int], bias_size: int | None, tp: TensorParallel,
                 weight_shard: Shard | None = None, bias_shard: Shard | None = None):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(weight_shape))
        if weight_shard is not None:
            self.weight.tp_shard = weight_shard
        if bias_size is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.empty(bias_size))
            if bias_shard is not None:
                self.bias.tp_shard = bias_shard

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight.dtype == torch.float8_e4m3fn:
            from metainfer_gen.kernels import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale_inv, bias)
        return self.gemm(x, self.weight, bias)


def configure_gemms(model: nn.Module) -> int:
    """Give every dense linear of ``model`` (layers with a ``gemm`` attribute: :class:`LinearBase`, the LM head) the
    GEMM implementation for its weight's dtype and device, chosen once and audited at site ``llm.linear``
    (:func:`metainfer_gen.kernels.gemm.select_linear`); fp8 layers keep their block GEMM. Returns how many layers
    were configured. Call again after moving the model to another device or dtype."""
    from metainfer_gen.kernels.gemm import select_linear

    chosen: dict[tuple, object] = {}
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(type(module), "gemm") or weight is None or not weight.is_floating_point() \
                or weight.element_size() < 2 or weight.is_meta:
            continue
        key = (weight.device, weight.dtype)
        if key not in chosen:
            chosen[key] = select_linear(weight.device, weight.dtype)
        module.gemm = chosen[key]
        count += 1
    return count


class ReplicatedLinear(LinearBase):
    """``y = x @ W.T (+ b)`` with the whole weight on every rank (vLLM ``ReplicatedLinear``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.in_features, self.out_features = in_features, out_features
        super().__init__((out_features, in_features), out_features if bias else None, TensorParallel.single())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``y[:, shard] = x @ W[shard].T (+ b[shard])``: x (T, in) replicated -> (T, out / size).

    Raises:
        ValueError: ``out_features`` not divisible by the tensor-parallel size.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallel | None = None):
        tp = tp or TensorParallel.single()
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = tp.split(out_features, "out_features")
        rows = Shard(0, tp.rank * self.out_per_rank, self.out_per_rank, out_features)
        super().__init__((self.out_per_rank, in_features), self.out_per_rank if bias else None, tp, rows, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class RowParallelLinear(LinearBase):
    """``y = sum over ranks of x[:, shard] @ W[:, shard].T (+ b)``: x (T, in / size) -> (T, out) on every rank.

    Args:
        reduce: sum over the group here (default); False returns this rank's partial product without the bias,
            for a caller that sums several partial results with one all-reduce (and then adds the bias itself).
    Raises:
        ValueError: ``in_features`` not divisible by the tensor-parallel size.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallel | None = None, reduce: bool = True):
        tp = tp or TensorParallel.single()
        self.in_features, self.out_features, self.reduce = in_features, out_features, reduce
        self.in_per_rank = tp.split(in_features, "in_features")
        super().__init__((out_features, self.in_per_rank), out_features if bias else None, tp,
                         Shard(1, tp.rank * self.in_per_rank, self.in_per_rank, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self._linear(x, self.bias)
        y = self._linear(x, None)
        if not self.reduce:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
