"""Give a meta-device model its final storage, then fill it in place, one checkpoint tensor (slice) at a time.

:func:`materialize` allocates every parameter and persistent buffer uninitialised on the target device in the
dtype it will keep: fp8 (float8_e4m3fn + a float32 ``weight_scale_inv`` grid) for the eligible linear layers
when the model runs in fp8, float32 for :data:`KEEP_FP32`, the run dtype for the rest; each MoE layer's dense
experts get their stacked storage at once (:meth:`~metainfer_gen.llm.layers.moe.MoE.stack_empty_experts`).
:func:`fill_parameter` then copies one checkpoint tensor, or this rank's slice of it (the parameter's
``tp_shard``), into that storage: the resident weights are allocated once, at their final size, and the only
transient is the one tensor in hand (a view of the mapped shard; a 128-row group of it in float32 when it is
quantised or dequantised). vLLM's ``weight_loader(param, loaded_weight)`` copies in place the same way.

Per parameter, by what the checkpoint holds and what the model keeps:

- fp8 weight + ``weight_scale_inv`` into an fp8 layer: the weight's slice and the scale blocks covering it,
  copied as they are (the slice must fall on 128 boundaries: :func:`~metainfer_gen.llm.fp8.block_scale_shard`);
- dense weight into an fp8 layer: the slice quantised with 128x128 block scales (``quantization="fp8"``), one row
  of tiles at a time (tiles are independent, so this is exact and bounds the float32 transient to 128 rows);
- fp8 weight into a dense layer (``kv_b_proj``; every layer of an FP8 checkpoint loaded where FP8 does not stay,
  :func:`~metainfer_gen.llm.fp8.choose_weight_format`): the 128-aligned rows/columns covering the slice,
  dequantised through :func:`metainfer_gen.kernels.fp8_weight_dequant` one group of 128-row tiles at a time
  (:data:`DEQUANT_BYTES` of float32) and cut to the slice, so the layer ends up exactly as if a dense checkpoint
  holding those values had been loaded (a slice that splits a scale block is fine here);
- an fp8 tensor without its ``weight_scale_inv``: refused (ValueError), its values mean nothing without scales;
- anything else: the slice, cast by the copy; a vocabulary shard's padded tail is zeroed.
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer_gen.llm.checkpoint import SafetensorsCheckpoint
from metainfer_gen.llm.checkpoint_checks import SCALE as _SCALE, check_stored
from metainfer_gen.llm.parallel import Shard

__all__ = ["DEQUANT_BYTES", "KEEP_FP32", "dequantise_into", "fill_parameter", "materialize"]

# float32 bytes of one group of 128-row tiles dequantised at a time (fp8 weight into a dense layer).
DEQUANT_BYTES = 16 << 20

# Kept in float32 whatever the run dtype, as transformers keeps them.
KEEP_FP32 = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")
_FP8 = torch.float8_e4m3fn


def _is_fp8_layer(module: nn.Module, fp8: bool) -> bool:
    from metainfer_gen.llm.layers.linear import LinearBase

    return fp8 and isinstance(module, LinearBase) and module.fp8_eligible


def materialize(model: nn.Module, *, dtype: torch.dtype, device: torch.device, fp8: bool) -> None:
    """Replace the meta parameters and persistent buffers of ``model`` by uninitialised storage on ``device``.

    Args:
        dtype: the run dtype (float32 for :data:`KEEP_FP32` names, float8_e4m3fn for fp8 layers' weights).
        fp8: give every ``fp8_eligible`` :class:`~metainfer_gen.llm.layers.linear.LinearBase` an fp8 weight and a
            (ceil(out/128), ceil(in/128)) float32 ``weight_scale_inv`` buffer.
    Shared (tied) parameters stay shared; ``tp_shard`` attributes are carried over. Non-persistent buffers are
    left as they are (the caller builds them).
    """
    from metainfer_gen.kernels.fp8_quant import FP8_BLOCK
    from metainfer_gen.llm.layers.moe import MoE

    for module in model.modules():
        if isinstance(module, MoE) and not fp8:
            module.stack_empty_experts(dtype, device)
    made: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        fp8_layer = _is_fp8_layer(module, fp8)
        for attr, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                name = f"{prefix}.{attr}" if prefix else attr
                kind = _FP8 if fp8_layer and attr == "weight" else torch.float32 if name.endswith(KEEP_FP32) \
                    else dtype
                new = nn.Parameter(torch.empty(param.shape, dtype=kind, device=device), requires_grad=False)
                if hasattr(param, "tp_shard"):
                    new.tp_shard = param.tp_shard
                made[id(param)] = new
            module._parameters[attr] = made[id(param)]
        for attr, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta and attr not in module._non_persistent_buffers_set:
                kind = torch.float32 if f"{prefix}.{attr}".endswith(KEEP_FP32) else dtype
                module._buffers[attr] = torch.empty(buffer.shape, dtype=kind, device=device)
        if fp8_layer:
            out, inp = module.weight.shape
            module.register_buffer(_SCALE, torch.empty(-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK),
                                                       dtype=torch.float32, device=device))


def _check_shape(name: str, stored: tuple[int, ...], target: torch.Tensor, shard: Shard | None) -> None:
    expected = list(target.shape)
    if shard is not None:
        expected[shard.dim] = shard.total
    if list(stored) != expected:
        raise RuntimeError(f"{name}: checkpoint shape {tuple(stored)} does not match the model's "
                           f"{tuple(expected)} (this rank holds {tuple(target.shape)})")


def _copy(target: torch.Tensor, data: torch.Tensor, shard: Shard | None) -> None:
    if shard is not None and shard.num_valid < shard.length:  # a vocabulary shard's padded tail
        target.narrow(shard.dim, shard.num_valid, shard.length - shard.num_valid).zero_()
        target = target.narrow(shard.dim, 0, shard.num_valid)
    target.copy_(data)


def dequantise_into(target: torch.Tensor, ckpt: SafetensorsCheckpoint, name: str, scale_name: str,
                    shard: Shard | None) -> None:
    """Fill ``target`` (this rank's ``shard`` of fp8 ``name``, None: all of it) with its dequantised values, a
    group of whole 128-row tiles at a time (about :data:`DEQUANT_BYTES` of float32; Triton on a GPU): each group
    reads the 128-aligned rows and columns covering the slice and the scale blocks over them (``scale_name``:
    float32/bf16/fp16 or ue8m0), so the transient is one group, never the tensor in float32. Used by both
    loaders (DeepSeek-V3 family and DeepSeek-V4).

    Args:
        target: the whole parameter when ``shard`` is given (its padded tail is zeroed), else the (N, K) tensor
            or view to fill.
    """
    from metainfer_gen.kernels import fp8_weight_dequant
    from metainfer_gen.kernels.fp8_quant import FP8_BLOCK

    if shard is not None and shard.num_valid < shard.length:  # a padded tail (none on linear layers today)
        target.narrow(shard.dim, shard.num_valid, shard.length - shard.num_valid).zero_()
        target = target.narrow(shard.dim, 0, shard.num_valid)
    n, k = ckpt.shape(name)
    rows = (shard.start, shard.num_valid) if shard is not None and shard.dim == 0 else (0, n)
    cols = (shard.start, shard.num_valid) if shard is not None and shard.dim == 1 else (0, k)
    col0, col_end = cols[0] // FP8_BLOCK * FP8_BLOCK, min(-(-(cols[0] + cols[1]) // FP8_BLOCK) * FP8_BLOCK, k)
    step = max(1, DEQUANT_BYTES // (4 * FP8_BLOCK * max(col_end - col0, 1))) * FP8_BLOCK
    row_end = rows[0] + rows[1]
    scale_cols = slice(col0 // FP8_BLOCK, -(-col_end // FP8_BLOCK))
    for start in range(rows[0] // FP8_BLOCK * FP8_BLOCK, row_end, step):
        stop = min(start + step, n)
        weight = ckpt.read(name, (slice(start, stop), slice(col0, col_end))).to(target.device).contiguous()
        scale = ckpt.read(scale_name, (slice(start // FP8_BLOCK, -(-stop // FP8_BLOCK)), scale_cols))
        dense = fp8_weight_dequant(weight, scale.to(target.device).float().contiguous(), target.dtype,
                                   site="loader")
        first, last = max(start, rows[0]), min(stop, row_end)
        target[first - rows[0]:last - rows[0]].copy_(dense[first - start:last - start,
                                                           cols[0] - col0:cols[0] - col0 + cols[1]])


def _quantise_into(module: nn.Module, data: torch.Tensor) -> None:
    """Quantise ``data`` (N, K) into ``module.weight`` / ``weight_scale_inv``, one row of 128x128 tiles at a time."""
    from metainfer_gen.kernels import quantize_fp8_weight
    from metainfer_gen.kernels.fp8_quant import FP8_BLOCK

    for row in range(0, data.shape[0], FP8_BLOCK):  # on the target device (a GPU quantises faster)
        weight, scale = quantize_fp8_weight(data[row:row + FP8_BLOCK].to(module.weight.device))
        module.weight[row:row + FP8_BLOCK].copy_(weight)
        getattr(module, _SCALE)[row // FP8_BLOCK].copy_(scale[0])


@torch.no_grad()
def fill_parameter(module: nn.Module, attr: str, ckpt: SafetensorsCheckpoint, name: str,
                   index: tuple | None = None) -> None:
    """Copy checkpoint tensor ``name`` into ``module.<attr>`` (allocated by :func:`materialize`): this rank's
    ``tp_shard`` of it (all of it when the parameter has none), or ``name[index]`` when ``index`` is given (one
    expert of a fused (E, ...) tensor, dense only); fp8 blocks and scales as the module docstring says.

    Raises:
        RuntimeError: the checkpoint tensor's shape is not the parameter's full shape.
        ValueError: an fp8 slice that would split a 128x128 scale block between ranks (into an fp8 layer), an fp8
            tensor stored without its ``weight_scale_inv``, or a ``weight_scale_inv`` beside a tensor that is not
            float8_e4m3fn (the tensor is named).
    """
    from metainfer_gen.llm.fp8 import block_scale_shard

    target = getattr(module, attr)
    if index is not None:
        stored = ckpt.dtype(name)
        if stored.startswith("F8"):
            raise ValueError(f"{name} is a fused expert tensor stored in fp8 ({stored}); fused experts load only "
                             f"in bf16/fp32: save them one per expert (mlp.experts.N.*.weight, each with its "
                             f"{_SCALE}) or in bf16")
        data = ckpt.read(name, index)
        _check_shape(f"{name}[{index}]", tuple(data.shape), target, None)
        if target.dtype == _FP8:
            _quantise_into(module, data)
        else:
            target.copy_(data)
        return
    shard = getattr(target, "tp_shard", None)
    _check_shape(name, ckpt.shape(name), target, shard)
    read_index = shard.index if shard is not None else ()
    scale_name = name.removesuffix("weight") + _SCALE
    stored_fp8 = name.endswith("weight") and scale_name in ckpt
    check_stored(name, ckpt.dtype(name), stored_fp8, scale_name)
    if target.dtype == _FP8:
        data = ckpt.read(name, read_index)
        if not stored_fp8:
            _quantise_into(module, data)
            return
        target.copy_(data)
        getattr(module, _SCALE).copy_(ckpt.read(scale_name, block_scale_shard(shard, name).index
                                                if shard is not None else ()))
    elif stored_fp8:
        dequantise_into(target, ckpt, name, scale_name, shard)
    else:
        _copy(target, ckpt.read(name, read_index), shard)
