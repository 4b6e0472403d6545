"""Load a DeepSeek-V4 checkpoint directory (config.json + safetensors) into the engine's V4 model, one tensor at a time.

Checkpoints name V4's weights as DeepSeek releases them (transformers' ``save_pretrained`` writes them back in that
form): ``layers.N.attn.wq_a``, ``attn.wkv``, ``attn_sink``, ``compressor.ape``, ``indexer.compressor.*``,
``hc_attn_fn``, ``ffn.experts.E.w1`` ... :func:`engine_name` maps each to the parameter it fills (transformers'
in-memory names, which the model uses), following transformers 5.24 ``conversion_mapping.py`` (``deepseek_v4``):
the same renames, and the per-expert ``w1`` / ``w3`` / ``w2`` into rows of the fused ``gate_up_proj`` (gate rows,
then up rows) and ``down_proj``. The model is built on the meta device, given its storage in the run dtype, and
filled from :class:`~metainfer_gen.llm.checkpoint.SafetensorsCheckpoint` reads (a slice of one tensor at a time).
Weights beyond ``num_hidden_layers`` (multi-token prediction) are skipped. Under tensor parallelism each rank
reads only its part of a split tensor (the parameter's ``tp_shard``: its rows or columns, safetensors
``get_slice``) and only its own experts' tensors, so no rank reads a split tensor whole.

FP8 block checkpoints (``quantization_config`` ``quant_method: "fp8"``, 128x128 blocks; DeepSeek's V4 releases)
load dequantised to the run dtype on every device (V4's layers hold no FP8 weights): each fp8 weight with its
scale (``.scale`` or ``.weight_scale_inv``, float32 or ue8m0) goes through the V3 loader's
:func:`~metainfer_gen.llm.weight_fill.dequantise_into`, this rank's slice a group of 128-row tiles at a time, so
a split that cuts a scale block is fine; FP4 (MXFP4) routed experts, as DeepSeek-V4-Flash ships them, are
dequantised expert by expert. What cannot be read (a missing or misshapen scale, another block size or method) is
refused from config.json and the headers before anything is allocated
(:mod:`~metainfer_gen.llm.models.deepseek_v4_fp8`).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
# In order, as transformers applies them to a layer's names (the indexer's renames before the generic ones).
_RENAMES = [(re.compile(pattern), target) for pattern, target in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"), (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"), (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))]
_TOP = {"head.weight": "lm_head.weight", "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


def engine_name(name: str, intermediate_size: int) -> tuple[str, tuple]:
    """The model parameter a checkpoint tensor fills, and the index of it (``()``: all of it).

    ``intermediate_size`` places an expert's ``w3`` (up) rows after its ``w1`` (gate) rows.
    """
    if name in _TOP:
        return _TOP[name], ()
    if name.startswith("layers."):
        name = "model." + name
    if not _LAYER.match(name):
        return name, ()
    expert = _EXPERT.search(name)
    if expert:
        e, w = int(expert.group(1)), expert.group(2)
        stem = name[:expert.start()].replace(".ffn", ".mlp")
        if w == "2":
            return f"{stem}.experts.down_proj", (e,)
        rows = slice(0, intermediate_size) if w == "1" else slice(intermediate_size, 2 * intermediate_size)
        return f"{stem}.experts.gate_up_proj", (e, rows)
    for pattern, target in _RENAMES:
        name = pattern.sub(target, name)
    return name, ()


def _destination(param: torch.Tensor, index: tuple) -> tuple[torch.Tensor, tuple, int] | None:
    """Where this rank puts a checkpoint tensor that fills ``param[index]`` (``index`` from :func:`engine_name`):
    (destination view, index to read from the checkpoint tensor, entries filled), or None when the tensor is
    another rank's (an expert it does not hold). A vocabulary shard's padded tail is zeroed and counted filled."""
    shard = getattr(param, "tp_shard", None)
    if shard is None:
        return (param[index] if index else param), (), (param[index] if index else param).numel()
    if index:  # one expert of the fused experts, split over ranks along dimension 0
        local = index[0] - shard.start
        if not 0 <= local < shard.length:
            return None
        dest = param[(local, *index[1:])]
        return dest, (), dest.numel()
    if shard.num_valid < shard.length:
        param.narrow(shard.dim, shard.num_valid, shard.length - shard.num_valid).zero_()
    return param.narrow(shard.dim, 0, shard.num_valid), shard.index, param.numel()


def _full_shape(dest: torch.Tensor, param: torch.Tensor, index: tuple) -> tuple[int, ...]:
    """The checkpoint shape a tensor filling ``dest`` must have (the whole tensor along a split dimension)."""
    shard = getattr(param, "tp_shard", None)
    if shard is None or index:
        return tuple(dest.shape)
    shape = list(param.shape)
    shape[shard.dim] = shard.total
    return tuple(shape)


def _read_names(ckpt, config) -> list[str]:
    """The tensors this load reads: not multi-token-prediction layers, not block scales (read with weights)."""
    from metainfer_gen.llm.models.deepseek_v4_fp8 import is_block_scale

    names = []
    for name in ckpt.names():
        match = _LAYER.match(name if not name.startswith("layers.") else "model." + name)
        if not ((match and int(match.group(1)) >= config.num_hidden_layers) or name.startswith("mtp.")
                or is_block_scale(ckpt, name)):
            names.append(name)
    return names


def load_v4_model(path: Path, config, *, dtype: torch.dtype, device: torch.device, max_positions: int, tp=None,
                  quantization: str | None = None):
    """The engine's :class:`~metainfer_gen.llm.models.deepseek_v4_engine.DeepseekV4ForCausalLM` with the
    checkpoint's weights, floating-point tensors in ``dtype`` (integer buffers such as ``tid2eid`` as stored; FP8
    block weights dequantised); ``tp`` (a :class:`~metainfer_gen.llm.parallel.TensorParallel`, None: one process)
    picks this rank's shards. ``model.weight_format`` says how the weights are held, and the audit (site
    ``llm.load.fp8``) records it for an FP8 checkpoint.

    Raises:
        ValueError: ``quantization="fp8"`` (V4 has no FP8 layers), a checkpoint quantisation other than 128x128
            FP8 blocks (and FP4 experts), an fp8 or FP4 weight without its scale or with a scale of the wrong shape
            or dtype, a weight in an integer dtype (from config.json and the headers, before anything is
            allocated).
        RuntimeError: model parameters the checkpoint lacks (or fills only in part), tensors the model has no
            place for, or a tensor of the wrong shape (names listed).
    """
    from metainfer_gen.llm.checkpoint import SafetensorsCheckpoint
    from metainfer_gen.llm.fp8 import checkpoint_quantization, choose_weight_format, record_weight_format
    from metainfer_gen.llm.models.deepseek_v4_engine import DeepseekV4ForCausalLM
    from metainfer_gen.llm.models.deepseek_v4_fp8 import (block_scale_of, check_v4_checkpoint, check_v4_quantization,
                                                          dequantise_fp4_into, is_fp4, unpacked_shape)
    from metainfer_gen.llm.models.families import FAMILIES
    from metainfer_gen.llm.weight_fill import dequantise_into

    fmt = choose_weight_format(quantization, checkpoint_quantization(config), device, dtype,
                               FAMILIES[config.model_type].no_fp8_layers)
    check_v4_quantization(config)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, max_positions, tp)
    shards = {name: p.tp_shard for name, p in model.named_parameters() if hasattr(p, "tp_shard")}
    filled: dict[str, int] = {}
    unexpected, wrong = [], []
    with SafetensorsCheckpoint(path) as ckpt:
        names = _read_names(ckpt, config)
        if check_v4_checkpoint(ckpt, names):  # headers only: refused before anything is allocated or read
            fmt = replace(fmt, name=fmt.name.replace("from fp8", "from fp8 (routed experts fp4)"))
        model.to(dtype).to_empty(device=device)  # new parameters: their tp_shard is carried over below
        for name, param in model.named_parameters():
            if name in shards:
                param.tp_shard = shards[name]
        targets = dict(model.named_parameters())
        targets.update(model.named_buffers())
        for name in names:
            target, index = engine_name(name, config.intermediate_size)
            if target not in targets:
                unexpected.append(name)
                continue
            with torch.no_grad():
                place = _destination(targets[target], index)
                if place is None:
                    continue
                dest, read_index, count = place
                full = _full_shape(dest, targets[target], index)
                if full != unpacked_shape(ckpt, name):
                    wrong.append(f"{name} {unpacked_shape(ckpt, name)} -> {target} {full}")
                    continue
                scale = block_scale_of(ckpt, name)
                if scale is None:
                    dest.copy_(ckpt.read(name, read_index))
                elif is_fp4(ckpt, name):  # a routed expert: whole on its rank
                    dequantise_fp4_into(dest, ckpt, name, scale)
                elif read_index:  # a split tensor: the whole parameter and its shard (padded tail zeroed)
                    dequantise_into(targets[target], ckpt, name, scale, targets[target].tp_shard)
                else:
                    dequantise_into(dest, ckpt, name, scale, None)
            filled[target] = filled.get(target, 0) + count
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in filled:
        model.lm_head.weight = model.model.embed_tokens.weight
        filled["lm_head.weight"] = model.lm_head.weight.numel()
    missing = sorted(n for n, t in targets.items() if filled.get(n, 0) != t.numel())
    if missing or unexpected or wrong:
        raise RuntimeError(f"checkpoint does not match the DeepSeek-V4 model: missing or partly filled {missing[:10]}, "
                           f"unexpected {unexpected[:10]}, wrong shapes {wrong[:10]}")
    model.build_rotary(device)
    model.weight_format = fmt
    record_weight_format(fmt)
    return model.eval()
