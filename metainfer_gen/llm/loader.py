"""Load a DeepSeek-V3 checkpoint directory (config.json + safetensors) into the engine's model.

Handles what checkpoints in the wild contain: experts saved one per expert (``mlp.experts.N.gate_proj.weight``,
what transformers' ``save_pretrained`` writes) or fused (``mlp.experts.gate_up_proj`` (E, 2I, H),
``mlp.experts.down_proj`` (E, H, I), transformers' in-memory layout); multi-token-prediction layers past
``num_hidden_layers`` (skipped); tied embeddings; and FP8 block-scaled weights (``weight_scale_inv`` with 128x128
blocks, DeepSeek's release format), dequantised here to the run dtype. A hub id is fetched with
``huggingface_hub.snapshot_download`` (works offline when it is already in the local cache).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32")
# Kept in float32 whatever the run dtype, as transformers keeps them.
KEEP_FP32 = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def resolve_checkpoint(path_or_id: str | Path) -> Path:
    """A local directory, or a hub id downloaded (or found in the cache).

    Raises:
        FileNotFoundError: a path-like string that does not exist, or a directory without config.json.
    """
    from metainfer_gen.platform import looks_like_path

    path = Path(path_or_id).expanduser()
    if not path.exists() and not looks_like_path(path_or_id) and str(path_or_id).count("/") == 1:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path_or_id), allow_patterns=["*.json", "*.safetensors", "*.model",
                                                                        "*.txt", "*.jinja"]))
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json; pass a directory saved by save_pretrained")
    return path


def load_config(path: Path):
    """The checkpoint's transformers config.

    Raises:
        ValueError: a model type the engine does not implement.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {config.model_type!r} in {path}/config.json is not supported by the engine; "
                         f"supported: {SUPPORTED_MODEL_TYPES}")
    return config


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 weight (N, K) with one scale per 128x128 block, ``scale_inv`` (ceil(N/128), ceil(K/128)), -> dtype,
    through :func:`metainfer_gen.kernels.fp8_weight_dequant` (partial last blocks keep their scale).

    Raises:
        ValueError: a scale grid that does not cover the weight's partial last blocks.
    """
    from metainfer_gen.kernels import fp8_weight_dequant

    return fp8_weight_dequant(weight, scale_inv.float(), dtype, site="loader")


def read_state_dict(path: Path, config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, renamed to the engine's modules and cast to ``dtype`` (the router stays
    float32, as transformers keeps it)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        raw.update(load_file(file))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= config.num_hidden_layers:
            continue  # multi-token-prediction layers
        if name.endswith("weight_scale_inv"):
            continue
        scale = raw.get(name.removesuffix("weight") + "weight_scale_inv") if name.endswith("weight") else None
        if scale is not None:
            tensor = dequantize_fp8_block(tensor, scale, dtype)
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                state[f"{prefix}{e}.gate_proj.weight"], state[f"{prefix}{e}.up_proj.weight"] = gate, up
            continue
        if name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                state[f"{prefix}{e}.down_proj.weight"] = down
            continue
        state[name] = tensor
    if "lm_head.weight" not in state and getattr(config, "tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return {k: v.float() if k.endswith(KEEP_FP32) else v.to(dtype) for k, v in state.items()}


def assign_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], quantize: str | None = None) -> None:
    """Assign checkpoint tensors to a (meta-device) model by name, through each parameter's ``weight_loader``.

    A parameter with a ``weight_loader`` (the tensor-parallel layers) receives ``weight_loader(full)``, its shard;
    the others receive the tensor as is. Checkpoint experts that live on another rank (names under a
    ``ModuleDict`` that lacks their key) are skipped. Equivalent to ``load_state_dict(strict=True, assign=True)``
    for a one-process model.

    Raises:
        RuntimeError: missing or unexpected names, or a tensor whose shape does not match its parameter.
    """
    expected = {name: t for name, t in model.named_parameters(remove_duplicate=False)}
    expected.update((name, t) for name, t in model.named_buffers(remove_duplicate=False)
                    if name.rpartition(".")[2] not in _non_persistent(model, name))
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(n for n in set(state) - set(expected) if not _held_elsewhere(model, n))
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:10]}"
                           f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
                           f"{' ...' if len(unexpected) > 10 else ''}")
    for name, current in expected.items():
        full = state[name]
        loader = getattr(current, "weight_loader", None)
        tensor = loader(full) if loader is not None else full
        if tuple(tensor.shape) != tuple(current.shape):
            raise RuntimeError(f"{name}: checkpoint shape {tuple(full.shape)} gives {tuple(tensor.shape)} on this "
                               f"rank; the model expects {tuple(current.shape)}")
        if tensor.numel() != full.numel():
            tensor = tensor.clone()  # a shard: do not keep the full tensor alive through a view
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if quantize == "fp8" and attr == "weight" and getattr(module, "fp8_eligible", False):
            from metainfer_gen.llm.fp8 import quantize_linear_fp8

            quantize_linear_fp8(module, tensor)
        elif attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=current.requires_grad)
        else:
            module._buffers[attr] = tensor


def _cast_dense(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the float32 parameters and buffers left after fp8 quantisation to ``dtype`` (KEEP_FP32 excepted)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.dtype != torch.float32 or name.endswith(KEEP_FP32) or name.endswith("weight_scale_inv"):
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor.to(dtype), requires_grad=False)
        elif attr not in module._non_persistent_buffers_set:
            module._buffers[attr] = tensor.to(dtype)


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
    """Build the model without allocating random weights, then assign the checkpoint's (this rank's shards of
    them under tensor parallelism ``tp``, a :class:`~metainfer_gen.llm.parallel.TensorParallel`).

    ``quantization="fp8"`` reads the checkpoint in float32 (an FP8 checkpoint dequantised exactly), quantises
    each rank's shard of the eligible linear weights to fp8 with 128x128 block scales, and casts the rest to
    ``dtype``. Last, each MoE layer's routed experts are stacked for grouped GEMMs
    (:func:`~metainfer_gen.llm.layers.moe.pack_moe_experts`; fp8 experts stay per expert).

    Raises:
        RuntimeError: missing, unexpected or wrongly shaped weights (names listed).
        ValueError: an unknown quantization method.
    """
    from metainfer_gen.llm.fp8 import QUANTIZATION_METHODS

    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}; got {quantization!r}")
    from metainfer_gen.llm.layers.moe import pack_moe_experts
    from metainfer_gen.llm.models.deepseek_v3 import DeepseekV3ForCausalLM, RotaryTables

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, max_positions, tp)
    state = read_state_dict(path, config, torch.float32 if quantization else dtype)
    assign_weights(model, state, quantize=quantization)
    if quantization:
        _cast_dense(model, dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = RotaryTables(config, max_positions)
    model = model.to(device).eval()
    pack_moe_experts(model)  # routed experts as grouped GEMMs over stacked weights (views: no extra memory)
    return model
