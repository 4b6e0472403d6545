"""Load a DeepSeek-V3 / V3.2 / GLM-5 checkpoint directory (config.json + safetensors) into the engine's model, streamed.

The model is built on the meta device, given its final storage (:func:`~metainfer_gen.llm.weight_fill.materialize`:
fp8 layers in fp8, MoE experts stacked) and filled one checkpoint tensor at a time, each rank reading only the
tensors it owns (its experts) and, for split layers, only its rows or columns (safetensors ``get_slice``,
:class:`~metainfer_gen.llm.checkpoint.SafetensorsCheckpoint`). No shard is read whole and no dict of tensors is
built, so loading needs the rank's weights plus about one tensor. Source followed: vLLM's per-parameter weight
loaders and DeepSeek-V3 ``inference/convert.py`` (per-rank slicing of a safetensors checkpoint).

Handles what checkpoints in the wild contain: experts saved one per expert (``mlp.experts.N.gate_proj.weight``,
what transformers' ``save_pretrained`` writes) or fused (``mlp.experts.gate_up_proj`` (E, 2I, H),
``mlp.experts.down_proj`` (E, H, I), transformers' in-memory layout); multi-token-prediction layers past
``num_hidden_layers`` (skipped, never read); tied embeddings; and FP8 block-scaled weights (``weight_scale_inv``
with 128x128 blocks, DeepSeek's release format), kept in fp8 when the model runs in fp8 and dequantised once, block
by block, to the run dtype otherwise. A checkpoint whose config declares ``quant_method: fp8`` runs in fp8 where the
device has an FP8 GEMM, and is dequantised at load elsewhere (the CPU), unless ``quantization="fp8"`` asks for fp8
(:func:`~metainfer_gen.llm.fp8.choose_weight_format`); the model's ``weight_format`` says which. A hub id is fetched
with ``huggingface_hub.snapshot_download`` (works offline when it is already in the local cache).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from metainfer_gen.llm.checkpoint_checks import FUSED_EXPERTS, check_checkpoint

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def resolve_checkpoint(path_or_id: str | Path) -> Path:
    """A local directory, or a hub id downloaded (or found in the cache).

    Raises:
        FileNotFoundError: a path-like string that does not exist, or a directory without config.json.
    """
    from metainfer_gen.platform import is_hub_id

    path = Path(path_or_id).expanduser()
    if not path.exists() and is_hub_id(path_or_id):
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path_or_id), allow_patterns=["*.json", "*.safetensors", "*.model",
                                                                        "*.txt", "*.jinja"]))
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json; pass a directory saved by save_pretrained")
    return path


def load_config(path: Path, engine_config=None):
    """The checkpoint's transformers config.

    Args:
        engine_config: an :class:`~metainfer_gen.llm.config.EngineConfig` whose settings the family must support
            (None: not checked).
    Raises:
        ValueError: a model type the engine does not implement, or one it recognises but cannot run yet
            (the message names what is missing; :mod:`~metainfer_gen.llm.models.families`), or engine settings
            the family cannot use yet (DeepSeek-V4: tensor parallelism, FP8).
    """
    from transformers import AutoConfig

    from metainfer_gen.llm.models.families import check_engine_settings, family_of

    config = AutoConfig.from_pretrained(path)
    try:
        family_of(config.model_type)
    except ValueError as exc:
        raise ValueError(f"{path}/config.json: {exc}") from None
    if engine_config is not None:
        check_engine_settings(config, tensor_parallel_size=engine_config.tensor_parallel_size,
                              quantization=engine_config.quantization, kv_cache_dtype=engine_config.kv_cache_dtype)
    return config


@dataclass(frozen=True, slots=True)
class _Read:
    """One fill: checkpoint tensor ``name`` (``index`` of it for a fused expert) into ``module.<attr>``."""

    module: torch.nn.Module
    attr: str
    name: str
    index: tuple | None = None


def _fused_reads(model: torch.nn.Module, ckpt, name: str) -> list[_Read]:
    """This rank's experts of a fused (E, 2I, H) ``gate_up_proj`` (gate rows, then up rows) or (E, H, I)
    ``down_proj``."""
    experts = model.get_submodule(name.rpartition(".")[0])
    rows = ckpt.shape(name)[1]
    reads = []
    for key, mlp in experts.items():
        e = int(key)
        if name.endswith("gate_up_proj"):
            reads += [_Read(mlp.gate_proj, "weight", name, (e, slice(0, rows // 2))),
                      _Read(mlp.up_proj, "weight", name, (e, slice(rows // 2, rows)))]
        else:
            reads.append(_Read(mlp.down_proj, "weight", name, (e,)))
    return reads


def plan_reads(model: torch.nn.Module, ckpt, config) -> list[_Read]:
    """Which checkpoint tensor fills which parameter on this rank, from names and headers only (nothing read).

    Skipped: multi-token-prediction layers, ``weight_scale_inv`` (read with its weight), experts held by other
    ranks, ``lm_head.weight`` when the embeddings are tied.

    Raises:
        RuntimeError: model parameters the checkpoint lacks, or checkpoint tensors the model has no place for
            (names listed).
    """
    expected = {name: t for name, t in model.named_parameters(remove_duplicate=False)}
    expected.update((name, t) for name, t in model.named_buffers(remove_duplicate=False)
                    if name.rpartition(".")[2] not in _non_persistent(model, name))
    tied = getattr(config, "tie_word_embeddings", False)
    reads, unexpected = [], []
    for name in ckpt.names():
        match = _LAYER.match(name)
        if (match and int(match.group(1)) >= config.num_hidden_layers) or name.endswith("weight_scale_inv") \
                or (tied and name == "lm_head.weight"):
            continue
        if name.endswith(FUSED_EXPERTS):
            reads += _fused_reads(model, ckpt, name)
        elif name in expected:
            module_name, _, attr = name.rpartition(".")
            reads.append(_Read(model.get_submodule(module_name), attr, name))
        elif not _held_elsewhere(model, name):
            unexpected.append(name)
    filled = {id(getattr(read.module, read.attr)) for read in reads}
    missing = sorted(name for name, t in expected.items() if id(t) not in filled)
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:10]}"
                           f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
                           f"{' ...' if len(unexpected) > 10 else ''}")
    return reads


def _non_persistent(model: torch.nn.Module, name: str) -> set[str]:
    return model.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set


def _held_elsewhere(model: torch.nn.Module, name: str) -> bool:
    """True for ``...experts.N.*`` when ``experts`` is a ModuleDict without key N (an expert on another rank)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        try:
            module = model.get_submodule(".".join(parts[:i]))
        except AttributeError:
            return False
        if isinstance(module, torch.nn.ModuleDict):
            return parts[i] not in module
    return False


def load_model(path: Path, config, *, dtype: torch.dtype, device: torch.device, max_positions: int, tp=None,
               quantization: str | None = None):
    """Build the model without allocating random weights, then fill it from the checkpoint, one tensor at a time
    (this rank's slices under tensor parallelism ``tp``, a :class:`~metainfer_gen.llm.parallel.TensorParallel`),
    straight into its storage on ``device``.

    ``quantization="fp8"`` gives every eligible linear layer a float8_e4m3fn weight with 128x128 block scales,
    on any device: an fp8 checkpoint's blocks are copied as they are, a bf16/fp32 checkpoint is quantised tensor by
    tensor (each rank its shard); the rest is cast to ``dtype``. With None, a checkpoint whose config declares
    DeepSeek's fp8 format stays fp8 where :func:`~metainfer_gen.llm.fp8.fp8_weights_stay` says the device has an
    FP8 GEMM (sm_89+/gfx94x+ with Triton), and elsewhere (the CPU) each fp8 weight is dequantised once, a group
    of 128-row tiles at a time, into a ``dtype`` weight without ``weight_scale_inv``, exactly as a bf16 checkpoint
    of those values would load. MoE layers' routed experts are stacked for grouped GEMMs as they are read (fp8
    experts stay per expert, each through the fp8 block GEMM).

    A DeepSeek-V4 config goes to :func:`~metainfer_gen.llm.models.deepseek_v4_loader.load_v4_model` (its own names
    and layout, this rank's shards under ``tp``; an FP8 checkpoint dequantised at load on every device).

    Returns:
        The model in eval mode, with ``weight_format`` (a :class:`~metainfer_gen.llm.fp8.WeightFormat`:
        ``.name`` such as ``"fp8 (block-scaled, FP8 GEMM)"``, ``"dequantised from fp8 at load to bfloat16"`` or
        ``"bfloat16"``, and ``.reason``); the choice is also recorded in the kernels audit (site
        ``"llm.load.fp8"``) when the checkpoint is fp8 or fp8 was asked for.

    Raises:
        RuntimeError: missing, unexpected or wrongly shaped weights (names listed), too few or too many experts.
        ValueError: an unknown quantization method, an unsupported checkpoint quantisation, an fp8 weight
            whose tensor-parallel slice would split a 128x128 scale block (fp8 kept), an fp8 tensor without its
            ``weight_scale_inv`` or with one of the wrong shape, or a weight stored in an integer dtype
            (:mod:`~metainfer_gen.llm.checkpoint_checks`, before anything is allocated).
    """
    if config.model_type == "deepseek_v4":  # its own layout and names (llm/models/deepseek_v4_loader.py)
        from metainfer_gen.llm.models.deepseek_v4_loader import load_v4_model

        return load_v4_model(path, config, dtype=dtype, device=device, max_positions=max_positions, tp=tp,
                             quantization=quantization)
    from metainfer_gen.llm.checkpoint import SafetensorsCheckpoint
    from metainfer_gen.llm.fp8 import checkpoint_quantization, choose_weight_format, record_weight_format
    from metainfer_gen.llm.models.deepseek_v3 import DeepseekV3ForCausalLM, RotaryTables
    from metainfer_gen.llm.weight_fill import fill_parameter, materialize

    fmt = choose_weight_format(quantization, checkpoint_quantization(config), device, dtype)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, max_positions, tp)
    with SafetensorsCheckpoint(path) as ckpt:
        reads = plan_reads(model, ckpt, config)
        check_checkpoint(ckpt, config, reads)  # headers only: refused before anything is allocated or read
        materialize(model, dtype=dtype, device=device, fp8=fmt.fp8)
        for read in reads:
            fill_parameter(read.module, read.attr, ckpt, read.name, read.index)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = RotaryTables(config, max_positions).to(device)
    model.weight_format = fmt
    record_weight_format(fmt)
    return model.eval()
