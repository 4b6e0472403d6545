"""FP8 weights for the engine's linear layers, applied from outside the model at load time.

``quantization="fp8"`` (``EngineConfig``) quantises every eligible linear weight to float8_e4m3fn with 128x128
block scales (DeepSeek-V3's format), after tensor-parallel sharding, so each rank's shard carries its own scale
grid and a shard whose size is not a multiple of 128 gets a partial last block with its own scale. A DeepSeek FP8
checkpoint (``weight`` in e4m3 + ``weight_scale_inv``, config ``quantization_config`` ``{"quant_method": "fp8",
"weight_block_size": [128, 128]}``) is loaded as it is stored: each rank reads its slice of the fp8 weight and the
matching rows/columns of the scale grid (:func:`block_scale_shard`), so its blocks and scales are the checkpoint's
bytes; a slice that does not start and end on a 128 boundary would split a scale block between ranks and is
refused.

Eligible: :class:`~metainfer_gen.llm.layers.linear.LinearBase` layers with ``fp8_eligible`` (attention, MLP,
experts, indexer ``wq_b``/``wk``). Not: embeddings, LM head, norms, the MoE router, MLA's ``kv_b_proj`` (read as
W_UK/W_UV in the absorbed form; vLLM dequantises it at load too) and the indexer's ``weights_proj`` (float32 in
transformers).

This is DeepSeek's published recipe. Sources: DeepSeek-V3 technical report (arXiv:2412.19437) section 3.3.1 keeps
"the embedding module, the output head, MoE gating modules, normalization operators, and attention operators" in
BF16/FP32; DeepSeek-V3 ``inference/model.py`` makes every ``Linear`` (``wq_a``, ``wq_b``, ``wkv_a``, ``wkv_b``,
``wo``, dense MLP, experts, shared experts) float8_e4m3fn with 128x128 ``scale`` blocks when ``dtype == "fp8"``,
while ``ParallelEmbedding``, the ``head`` (``dtype=torch.get_default_dtype()``), ``Gate.weight`` and ``RMSNorm``
stay BF16; DeepSeek-V3.2-Exp ``inference/model.py`` adds the indexer with ``wq_b``/``wk`` as FP8 ``Linear`` and
``weights_proj`` in float32. The one difference is ``kv_b_proj`` (``wkv_b``): DeepSeek stores it in FP8 but its
absorbed attention calls ``weight_dequant`` on it before use, and vLLM's MLA backend likewise dequantises it into
W_UK/W_UV at load; we keep it in the run dtype (a bf16 checkpoint is not rounded to fp8 there; an FP8 checkpoint's
values are dequantised, as vLLM does). vLLM's ``Fp8Config`` quantises only ``LinearBase`` layers not in
``ignored_layers`` (``modules_to_not_convert`` in transformers' ``FineGrainedFP8Config``); in vLLM's
``deepseek_v2.py`` the router (``GateLinear``, built without a quant config) and ``ParallelLMHead`` /
``VocabParallelEmbedding`` stay unquantised. Measured on the embedded LLM: see ``docs/demo_llm.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metainfer_gen.kernels.fp8_quant import FP8_BLOCK
from metainfer_gen.llm.parallel import Shard

__all__ = ["QUANTIZATION_METHODS", "Fp8Summary", "block_scale_shard", "checkpoint_quantization",
           "quantize_linear_fp8", "weight_bytes"]

QUANTIZATION_METHODS = ("fp8",)


def quantize_linear_fp8(module: nn.Module, weight: torch.Tensor) -> None:
    """Give ``module`` the fp8 form of ``weight`` (its (out, in) shard, any float dtype): ``weight`` becomes
    float8_e4m3fn and a ``weight_scale_inv`` buffer (ceil(out/128), ceil(in/128)) float32 is registered."""
    from metainfer_gen.kernels import quantize_fp8_weight

    q, scale = quantize_fp8_weight(weight)
    module._parameters["weight"] = nn.Parameter(q, requires_grad=False)
    module.register_buffer("weight_scale_inv", scale)


def checkpoint_quantization(config) -> str | None:
    """``"fp8"`` when the checkpoint's config declares DeepSeek's FP8 format (``quantization_config`` with
    ``quant_method`` ``"fp8"`` and ``weight_block_size`` [128, 128], as DeepSeek-V3 ships), else None.

    Raises:
        ValueError: another quantisation method, or another block size (the GEMM's scales are 128x128).
    """
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"checkpoint quantization_config quant_method {method!r} is not supported; the engine "
                         f"loads bf16/fp32 checkpoints and DeepSeek-style fp8 (quant_method 'fp8')")
    block = list(qc.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK])
    if block != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(f"fp8 checkpoint weight_block_size {block} is not supported; the fp8 GEMM needs "
                         f"[{FP8_BLOCK}, {FP8_BLOCK}] blocks")
    return "fp8"


def block_scale_shard(shard: Shard, name: str) -> Shard:
    """The part of a (ceil(N/128), ceil(K/128)) ``weight_scale_inv`` grid that scales ``shard`` of an (N, K) fp8
    weight.

    Raises:
        ValueError: the shard does not start on a 128 boundary, or ends inside the tensor off one: a scale block
            would be split between ranks (``name`` and the sizes that would work are in the message).
    """
    start, end = shard.start, shard.start + shard.num_valid
    if start % FP8_BLOCK or (end % FP8_BLOCK and end != shard.total):
        what = ("rows", "columns")[shard.dim]
        raise ValueError(f"{name}: this rank's {what} [{start}, {end}) of the fp8 weight's {shard.total} do not "
                         f"fall on its {FP8_BLOCK}x{FP8_BLOCK} scale blocks, so a block would be split between "
                         f"ranks; use a tensor_parallel_size that splits dimension {shard.dim} into multiples of "
                         f"{FP8_BLOCK}, or a bf16 checkpoint with quantization='fp8' (quantised per shard)")
    return Shard(shard.dim, start // FP8_BLOCK, -(-shard.num_valid // FP8_BLOCK), -(-shard.total // FP8_BLOCK))


@dataclass(frozen=True, slots=True)
class Fp8Summary:
    """Bytes of the linear weights (scales included) and how many layers hold fp8."""

    num_fp8_layers: int
    num_layers: int
    linear_weight_bytes: int


def weight_bytes(model: nn.Module) -> Fp8Summary:
    """Count the bytes of every :class:`LinearBase` weight (plus its fp8 scales) in ``model``."""
    from metainfer_gen.llm.layers.linear import LinearBase

    num_fp8 = num = total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            num += 1
            total += module.weight.numel() * module.weight.element_size()
            scale = getattr(module, "weight_scale_inv", None)
            if scale is not None:
                num_fp8 += 1
                total += scale.numel() * scale.element_size()
    return Fp8Summary(num_fp8, num, total)
