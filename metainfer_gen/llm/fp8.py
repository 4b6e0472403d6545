"""FP8 weights for the engine's linear layers, applied from outside the model at load time.

``quantization="fp8"`` (``EngineConfig``) quantises every eligible linear weight to float8_e4m3fn with 128x128
block scales (DeepSeek-V3's format), after tensor-parallel sharding, so each rank's shard carries its own scale
grid and a shard whose size is not a multiple of 128 gets a partial last block with its own scale. A DeepSeek FP8
checkpoint (``weight`` in e4m3 + ``weight_scale_inv``) is dequantised to float32 on read and quantised again here:
for tiles that stay aligned (every tile of a one-process load, and TP shards on 128 boundaries) this gives the
checkpoint's bytes and scales back exactly, since each tile's largest value is 448 times its scale.

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

__all__ = ["QUANTIZATION_METHODS", "Fp8Summary", "quantize_linear_fp8", "weight_bytes"]

QUANTIZATION_METHODS = ("fp8",)


def quantize_linear_fp8(module: nn.Module, weight: torch.Tensor) -> None:
    """Give ``module`` the fp8 form of ``weight`` (its (out, in) shard, any float dtype): ``weight`` becomes
    float8_e4m3fn and a ``weight_scale_inv`` buffer (ceil(out/128), ceil(in/128)) float32 is registered."""
    from metainfer_gen.kernels import quantize_fp8_weight

    q, scale = quantize_fp8_weight(weight)
    module._parameters["weight"] = nn.Parameter(q, requires_grad=False)
    module.register_buffer("weight_scale_inv", scale)


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
