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

Where FP8 stays FP8 (:func:`fp8_weights_stay`, :func:`choose_weight_format`): an FP8 checkpoint loaded without
``quantization="fp8"`` keeps its fp8 blocks only on a GPU with FP8 matrix arithmetic (sm_89+, gfx94x+) and Triton,
where :func:`metainfer_gen.kernels.fp8_linear` is a real FP8 GEMM. Elsewhere (the CPU: fp8 tensors support no
arithmetic there, and the torch fallback dequantises a slice of the weight on every call, 9-50x slower than a
dense linear) each fp8 weight is dequantised once while loading, block by block, to the run dtype. An explicit
``quantization="fp8"`` keeps FP8 everywhere (half the weight memory of bf16). The loaded model's ``weight_format``
(a :class:`WeightFormat`: ``name``, ``reason``) says which happened, and the kernels audit gets an entry at site
``llm.load.fp8`` (:func:`record_weight_format`). A model without FP8 layers (DeepSeek-V4: ``model_refusal`` of
:func:`choose_weight_format`) has its FP8 checkpoint dequantised at load on every device, by the same loader code
(:func:`metainfer_gen.llm.weight_fill.dequantise_into`), and refuses ``quantization="fp8"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metainfer_gen.kernels.fp8_quant import FP8_BLOCK
from metainfer_gen.llm.parallel import Shard

__all__ = ["AUDIT_OP", "AUDIT_SITE", "QUANTIZATION_METHODS", "Fp8Summary", "WeightFormat", "block_scale_shard",
           "checkpoint_quantization", "choose_weight_format", "fp8_weights_stay", "quantize_linear_fp8",
           "record_weight_format", "weight_bytes"]

QUANTIZATION_METHODS = ("fp8",)
AUDIT_OP, AUDIT_SITE = "fp8_weights", "llm.load.fp8"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fp8_weights_stay(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """Whether an FP8 checkpoint's weights should stay FP8 on ``device``, and why (one sentence).

    True on a CUDA/ROCm device when :func:`metainfer_gen.platform.capabilities` reports ``fp8_e4m3`` (FP8 matrix
    arithmetic: sm_89+, gfx94x+) and Triton compiles there (the block-scaled FP8 GEMM is a Triton kernel). False on
    the CPU, on other device types, on GPUs without FP8, and where Triton does not compile: there an FP8 linear
    dequantises its weight on every call, so it is better dequantised once at load to ``dtype``.

    Args:
        device: where the model runs (``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``).
        dtype: the run dtype, named in the reason.
    Returns:
        ``(stay, reason)``.
    """
    from metainfer_gen import platform

    device = torch.device(device)
    once = f"FP8 weights are dequantised once at load to {_dtype_name(dtype)}"
    if device.type == "cpu":
        return False, (f"CPU: no FP8 GEMM (fp8 tensors support no arithmetic); the per-call dequant is 9-50x "
                       f"slower than a dense linear, so {once}")
    if device.type != "cuda":
        return False, f"{device.type}: no FP8 GEMM in this engine, so {once}"
    caps = platform.capabilities()
    kind = caps.device_kind.value.upper()
    arch = ", ".join(caps.gcn_arch) or ", ".join(f"sm_{a}{b}" for a, b in caps.compute_capabilities) or "unknown"
    if not (caps.has_gpu and caps.fp8_e4m3):
        return False, (f"{kind} {arch}: no FP8 matrix arithmetic (needs sm_89+ or gfx94x+), so {once}")
    triton = platform.triton_status()
    if triton.mode is not platform.TritonMode.COMPILE:
        return False, f"{kind} {arch}: the FP8 GEMM is a Triton kernel and {triton.reason}, so {once}"
    return True, f"{kind} {arch}: FP8 GEMM in hardware, so FP8 weights stay FP8 with their 128x128 block scales"


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How the linear weights of a loaded model are held.

    Attributes:
        fp8: eligible linear layers hold float8_e4m3fn weights with ``weight_scale_inv`` (False: the run dtype).
        dequantise: the checkpoint's fp8 weights are dequantised once at load (a declared FP8 checkpoint where
            FP8 does not stay); a dense layer reading an fp8 tensor (``kv_b_proj``) always dequantises it.
        fp8_gemm: the device has an FP8 GEMM (:func:`fp8_weights_stay`).
        name: what the engine and doctor print (``"fp8 (block-scaled, FP8 GEMM)"``,
            ``"dequantised from fp8 at load to bfloat16"``, ``"bfloat16"``).
        reason: why, one sentence.
    """

    fp8: bool
    dequantise: bool
    fp8_gemm: bool
    name: str
    reason: str

    def __str__(self) -> str:
        return self.name


def choose_weight_format(requested: str | None, declared: str | None, device: torch.device | str,
                         dtype: torch.dtype, model_refusal: str | None = None) -> WeightFormat:
    """The weight format a model loads in: ``requested`` is the user's ``quantization`` (None or ``"fp8"``),
    ``declared`` the checkpoint's (:func:`checkpoint_quantization`), ``dtype`` the run dtype.

    ``"fp8"`` requested keeps FP8 on every device (the user asked; half the memory of bf16). A declared FP8
    checkpoint stays FP8 where :func:`fp8_weights_stay` says so, and is dequantised at load elsewhere. Anything
    else runs in ``dtype``. ``model_refusal`` (a sentence; None: the model has FP8 layers) says why the model
    holds no FP8 weights: a declared FP8 checkpoint is then dequantised at load on every device (``fp8_gemm``
    still says whether the device has an FP8 GEMM, so the audit can name the refused path).

    Raises:
        ValueError: ``requested`` not None and not in :data:`QUANTIZATION_METHODS`, or ``"fp8"`` requested
            from a model with a ``model_refusal``.
    """
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}; got {requested!r}")
    stay, why = fp8_weights_stay(device, dtype)
    if model_refusal is not None:
        if requested == "fp8":
            raise ValueError(f"quantization='fp8': {model_refusal}; leave quantization unset (an FP8 checkpoint is "
                             f"then dequantised once at load to {_dtype_name(dtype)})")
        if declared == "fp8":
            reason = f"{model_refusal}, so FP8 weights are dequantised once at load to {_dtype_name(dtype)}"
            return WeightFormat(False, True, stay, f"dequantised from fp8 at load to {_dtype_name(dtype)}",
                                reason if stay else f"{why}; {model_refusal}")
    if requested == "fp8":
        if stay:
            return WeightFormat(True, False, True, "fp8 (block-scaled, FP8 GEMM)",
                                f"quantization='fp8' requested; {why}")
        where = why.split(":", 1)[0]
        return WeightFormat(True, False, False, "fp8 (block-scaled; no FP8 GEMM here: dequantised per call)",
                            f"quantization='fp8' requested: FP8 weights kept (half the memory of bf16) although "
                            f"{where} has no FP8 GEMM, so every FP8 linear dequantises its weight per call (9-50x "
                            f"slower than a dense linear on a CPU; leave quantization unset to dequantise once)")
    if declared == "fp8":
        if stay:
            return WeightFormat(True, False, True, "fp8 (block-scaled, FP8 GEMM)", why)
        return WeightFormat(False, True, False, f"dequantised from fp8 at load to {_dtype_name(dtype)}",
                            f"{why} (quantization='fp8' keeps them FP8)")
    return WeightFormat(False, False, stay, _dtype_name(dtype),
                        "the checkpoint's weights are not FP8 and no quantization was requested")


def record_weight_format(fmt: WeightFormat) -> None:
    """Put ``fmt`` in the kernels audit (op :data:`AUDIT_OP`, site :data:`AUDIT_SITE`): path ``"fp8"`` or
    ``"dense"`` (dequantised at load), with ``dense`` refused, and why, when FP8 was kept on a device without an
    FP8 GEMM, and ``fp8`` refused, and why, when a device with an FP8 GEMM got dequantised weights (a model
    without FP8 layers). Records nothing for a checkpoint that is not FP8 loaded without an FP8 request."""
    from metainfer_gen.kernels.audit_log import Refusal, record

    if not (fmt.fp8 or fmt.dequantise):
        return
    refusals = ((Refusal("dense", fmt.reason),) if fmt.fp8 and not fmt.fp8_gemm else
                (Refusal("fp8", fmt.reason),) if fmt.dequantise and fmt.fp8_gemm else ())
    record(AUDIT_OP, AUDIT_SITE, "fp8" if fmt.fp8 else "dense", refusals)


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
