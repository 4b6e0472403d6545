"""Refuse a checkpoint the engine cannot load right, from the safetensors headers alone, before any storage is
allocated or any weight is read: every refusal names the tensor and what would make it loadable.

Checked, for the tensors :func:`~metainfer_gen.llm.loader.plan_reads` will fill: the stored dtype is a float one
(an int8/int4-packed weight would be cast to floats silently and produce garbage); an fp8 weight has its
``weight_scale_inv`` and the scale has the (ceil(N/128), ceil(K/128)) float shape of the weight's 128x128 blocks
(a wrong grid would broadcast, or scale the wrong blocks, without an error); a ``weight_scale_inv`` sits only
beside an e4m3 weight; a fused expert tensor holds exactly ``n_routed_experts`` experts; and no per-expert tensor
names an expert past ``n_routed_experts`` (it would be taken for another rank's expert and skipped). Missing
experts are :func:`~metainfer_gen.llm.loader.plan_reads`'s "missing" list.
"""

from __future__ import annotations

import re

__all__ = ["FLOAT_DTYPES", "FUSED_EXPERTS", "SCALE", "check_checkpoint", "check_scale", "check_stored"]

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # safetensors' names of the float dtypes
SCALE = "weight_scale_inv"
_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")  # E8M0: ue8m0 powers of two (DeepSeek-V4)
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # (E, 2I, H), (E, H, I) tensors
_BLOCK = 128


def check_stored(name: str, stored: str, scaled: bool, scale_name: str) -> None:
    """Refuse a weight ``name`` stored as ``stored`` (safetensors dtype) that cannot be read as floats: an integer
    dtype, an fp8 tensor without its block scales (``scaled``: ``scale_name`` is in the checkpoint), or block
    scales beside a tensor that is not e4m3.

    Raises:
        ValueError: naming the tensor and the way out.
    """
    if stored not in FLOAT_DTYPES:
        raise ValueError(f"{name} is stored as {stored}, not a float dtype: the engine loads bf16/fp16/fp32 weights, "
                         f"or DeepSeek's fp8 (F8_E4M3 with {SCALE}); integer-quantised weights (GPTQ, AWQ, int8) "
                         f"are not supported: dequantise the checkpoint to bf16")
    if scaled and stored != "F8_E4M3":
        raise ValueError(f"{name} has a {SCALE} but is stored as {stored}, not float8_e4m3fn (F8_E4M3)")
    if not scaled and stored.startswith("F8"):
        raise ValueError(f"{name} is stored in fp8 ({stored}) but the checkpoint has no {scale_name}: its values "
                         f"cannot be read without their 128x128 block scales; add {scale_name} (ceil(N/128), "
                         f"ceil(K/128)) float32 to the checkpoint, or save {name} in bf16/fp32")


def check_scale(ckpt, name: str, scale_name: str) -> None:
    """Refuse a block-scale tensor ``scale_name`` that is not one float (or ue8m0) per 128x128 block of the fp8
    weight ``name``, from the headers of ``ckpt``.

    Raises:
        ValueError: a weight that is not 2-D, a scale grid of another shape or dtype (both named).
    """
    shape = ckpt.shape(name)
    expected = tuple(-(-size // _BLOCK) for size in shape)
    stored, dtype = ckpt.shape(scale_name), ckpt.dtype(scale_name)
    if len(shape) != 2 or stored != expected or dtype not in _SCALE_DTYPES:
        raise ValueError(f"{scale_name} is {dtype} {stored}, but the fp8 weight {name} {shape} needs one float32 "
                         f"(or ue8m0) scale per 128x128 block: shape {expected}; re-export the checkpoint's scales")


def check_checkpoint(ckpt, config, reads) -> None:
    """Check every tensor that ``reads`` (:func:`~metainfer_gen.llm.loader.plan_reads`) will fill, and the expert
    count of every MoE layer, from the headers of ``ckpt`` (a
    :class:`~metainfer_gen.llm.checkpoint.SafetensorsCheckpoint`); nothing is read or allocated.

    Raises:
        ValueError: a non-float weight, an fp8 weight without its scale, a scale of the wrong shape or dtype.
        RuntimeError: a fused expert tensor whose expert count is not ``config.n_routed_experts``, or a
            per-expert tensor of an expert past it.
    """
    num_experts = getattr(config, "n_routed_experts", None) or 0
    for name in sorted({read.name for read in reads}):
        scale_name = name.removesuffix("weight") + SCALE
        scaled = name.endswith("weight") and scale_name in ckpt
        check_stored(name, ckpt.dtype(name), scaled, scale_name)
        if scaled:
            check_scale(ckpt, name, scale_name)
        if name.endswith(FUSED_EXPERTS) and ckpt.shape(name)[0] != num_experts:
            raise RuntimeError(f"{name} holds {ckpt.shape(name)[0]} experts but config.json's n_routed_experts is "
                               f"{num_experts}: the checkpoint and its config do not match")
    for name in ckpt.names():
        found = _EXPERT.match(name)
        if found and int(found.group(1)) < config.num_hidden_layers and int(found.group(2)) >= num_experts:
            raise RuntimeError(f"{name} is expert {found.group(2)}, but config.json's n_routed_experts is "
                               f"{num_experts} (experts 0..{num_experts - 1}): the checkpoint has more experts "
                               f"than its config")
