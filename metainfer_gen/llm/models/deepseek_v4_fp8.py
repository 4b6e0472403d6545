"""DeepSeek-V4 FP8 block checkpoints: which tensors are block scales, and what is refused before anything is read.

DeepSeek's V4 releases store the linear weights (attention ``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, the
indexer's ``wq_b``, the shared and routed experts' ``w1``/``w2``/``w3``) as float8_e4m3fn with one scale per
128x128 block, the scale named ``<module>.scale`` (transformers 5.25's FP8 quantizer renames ``.scale`` to
``.weight_scale_inv``; both names are read here), stored as float32 or as ue8m0 (float8_e8m0fnu powers of two,
``scale_fmt: "ue8m0"``). The compressors' ``wkv``/``wgate``, the indexer's ``weights_proj``, the routers, the
embedding and the head ship in bf16 without a scale (transformers lists the compressor and indexer ones in
``_keep_in_fp32_modules`` so its quantizer skips them); they load as dense tensors. Routed experts are FP8 blocks
in some releases (``expert_dtype: "fp8"``, DeepSeek-V4-Flash-Base) and MXFP4 in others (``expert_dtype: "fp4"``,
DeepSeek-V4-Flash): e2m1 values two per int8 byte (the even element in the low nibble), (N, K/2), with one
scale per 32 values of a row, (N, K/32), ue8m0 or float.

The engine's V4 layers hold no FP8 weights (the family table's ``no_fp8_layers``,
:mod:`~metainfer_gen.llm.models.families`), so every FP8 weight is dequantised once while
loading, on every device, through the DeepSeek-V3 loader's code
(:func:`~metainfer_gen.llm.weight_fill.dequantise_into`: this rank's slice, a group of 128-row tiles at a time,
the scale blocks covering it); an FP4 expert (whole on its rank) is dequantised by :func:`dequantise_fp4_into`,
:data:`FP4_ROWS` rows at a time, as transformers' ``Fp8Dequantize`` does it.
:func:`~metainfer_gen.llm.fp8.choose_weight_format` names the result and the audit records it. Sources:
transformers 5.25 ``integrations/finegrained_fp8.py`` (``FP8Experts``, ``Fp8Dequantize``),
``quantizers/quantizer_finegrained_fp8.py`` (the ``.scale`` rename),
``models/deepseek_v4/modeling_deepseek_v4.py`` (``_keep_in_fp32_modules``); vLLM's ``DeepseekV4FP8Config``.
"""

from __future__ import annotations

import re

from metainfer_gen.llm.checkpoint_checks import SCALE, check_scale, check_stored

__all__ = ["FP4_GROUP", "FP4_ROWS", "SCALE_NAMES", "block_scale_of", "check_v4_checkpoint",
           "check_v4_quantization", "dequantise_fp4_into", "is_block_scale", "is_fp4", "unpacked_shape"]

SCALE_NAMES = (SCALE, "scale")  # transformers' name, then DeepSeek-V4's own
FP4_GROUP = 32  # values of a row per FP4 scale
FP4_ROWS = 1024  # rows of an FP4 expert dequantised at a time (bounds the float32 transient)
# e2m1 codes 0..15 (bit 3 the sign), as transformers' Fp8Dequantize._FP4_E2M1_LUT
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PACKED = ("I8", "U8")  # how safetensors stores FP4 pairs
_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")


def _quantization_config(config) -> dict:
    qc = getattr(config, "quantization_config", None) or {}
    return qc if isinstance(qc, dict) else qc.to_dict()


def check_v4_quantization(config) -> None:
    """Refuse, from config.json alone, a DeepSeek-V4 expert format the engine cannot read (before any process group
    or weight): an ``expert_dtype`` (in ``quantization_config``, or at the top level as V4's first configs put it)
    other than ``"fp8"`` and ``"fp4"``, the two transformers 5.25 reads.

    Raises:
        ValueError: naming the setting.
    """
    expert_dtype = _quantization_config(config).get("expert_dtype", getattr(config, "expert_dtype", None))
    if expert_dtype not in (None, "fp8", "fp4"):
        raise ValueError(f"deepseek_v4 checkpoint with expert_dtype {expert_dtype!r}: the engine reads FP8-block "
                         f"('fp8') and MXFP4 ('fp4') routed experts, as transformers does")


def block_scale_of(ckpt, name: str) -> str | None:
    """The block-scale tensor of weight ``name`` in ``ckpt`` (``<module>.weight_scale_inv`` or ``<module>.scale``),
    or None when it has none (a dense tensor)."""
    if not name.endswith(".weight"):
        return None
    stem = name.removesuffix("weight")
    return next((stem + suffix for suffix in SCALE_NAMES if stem + suffix in ckpt), None)


def is_block_scale(ckpt, name: str) -> bool:
    """True for a scale read with its weight (``X.weight_scale_inv`` or ``X.scale`` beside an ``X.weight``); a
    parameter merely named ``scale`` (the hyper-connections' ``attn_hc.scale``) has no ``weight`` beside it."""
    for suffix in SCALE_NAMES:
        if name.endswith("." + suffix):
            return name.removesuffix(suffix) + "weight" in ckpt
    return False


def is_fp4(ckpt, name: str) -> bool:
    """True for an FP4-packed weight: integer storage beside a block scale."""
    return ckpt.dtype(name) in _PACKED and block_scale_of(ckpt, name) is not None


def unpacked_shape(ckpt, name: str) -> tuple[int, ...]:
    """The shape ``name`` holds once read: an FP4 weight's stored (N, K/2) is (N, K); others as stored."""
    shape = ckpt.shape(name)
    return (*shape[:-1], 2 * shape[-1]) if is_fp4(ckpt, name) else shape


def _check_fp4(ckpt, name: str, scale: str) -> None:
    n, k = unpacked_shape(ckpt, name)
    expected = (n, -(-k // FP4_GROUP))
    if not _EXPERT.search(name):
        raise ValueError(f"{name} is FP4-packed ({ckpt.dtype(name)} with {scale}), but only DeepSeek-V4's routed "
                         f"experts (experts.N.w1/w2/w3) are FP4 in its releases; save it in fp8 blocks or bf16")
    if ckpt.shape(scale) != expected or ckpt.dtype(scale) not in _SCALE_DTYPES:
        raise ValueError(f"{scale} is {ckpt.dtype(scale)} {ckpt.shape(scale)}, but the FP4 expert weight {name} "
                         f"(N, K) = {(n, k)} needs one float32 (or ue8m0) scale per {FP4_GROUP} values of a row: "
                         f"shape {expected}; re-export the checkpoint's scales")


def check_v4_checkpoint(ckpt, names: list[str]) -> bool:
    """Check the tensors ``names`` (those this load will read, scales excluded) from the headers of ``ckpt`` (a
    :class:`~metainfer_gen.llm.checkpoint.SafetensorsCheckpoint`); nothing is read or allocated.

    Refused: a weight stored in an integer dtype that is not an FP4 expert with its (N, K/32) scales, an fp8 tensor
    without its scale, a scale beside a tensor that is not float8_e4m3fn, an fp8 scale grid that is not one
    float32/bf16/fp16/ue8m0 value per 128x128 block (:func:`~metainfer_gen.llm.checkpoint_checks.check_scale`).
    Integer buffers (the hash router's ``tid2eid``) are not weights and pass.

    Returns:
        Whether any routed expert is FP4.
    Raises:
        ValueError: naming the tensor and the way out.
    """
    fp4 = False
    for name in names:
        stored, scale = ckpt.dtype(name), block_scale_of(ckpt, name)
        if scale is not None and stored in _PACKED:
            _check_fp4(ckpt, name, scale)
            fp4 = True
            continue
        if name.endswith("weight") or stored.startswith("F8") or scale is not None:
            check_stored(name, stored, scale is not None, scale or name.removesuffix("weight") + "scale")
        if scale is not None:
            check_scale(ckpt, name, scale)
    return fp4


def dequantise_fp4_into(target, ckpt, name: str, scale_name: str) -> None:
    """Fill ``target`` (N, K) with FP4 expert ``name`` ((N, K/2) int8, two e2m1 codes a byte, the even element in
    the low nibble) times its ``scale_name`` ((N, K/32), ue8m0 or float), :data:`FP4_ROWS` rows at a time."""
    import torch

    lut = torch.tensor(_E2M1, dtype=torch.float32, device=target.device)
    for start in range(0, target.shape[0], FP4_ROWS):
        rows = slice(start, min(start + FP4_ROWS, target.shape[0]))
        codes = ckpt.read(name, (rows,)).to(target.device).view(torch.uint8)
        values = torch.stack([lut[(codes & 15).long()], lut[(codes >> 4).long()]], dim=-1).flatten(-2)
        scale = ckpt.read(scale_name, (rows,)).to(target.device).float().repeat_interleave(FP4_GROUP, dim=-1)
        target[rows].copy_(values * scale[:, :values.shape[-1]])
