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

SUPPORTED_MODEL_TYPES = ("deepseek_v3",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def resolve_checkpoint(path_or_id: str | Path) -> Path:
    """A local directory, or a hub id downloaded (or found in the cache).

    Raises:
        FileNotFoundError: a path-like string that does not exist, or a directory without config.json.
    """
    path = Path(path_or_id).expanduser()
    looks_like_path = path.is_absolute() or str(path_or_id).startswith((".", "~")) or path.exists()
    if not looks_like_path and str(path_or_id).count("/") == 1:
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
    """FP8 weight (N, K) with one scale per 128x128 block, ``scale_inv`` (ceil(N/128), ceil(K/128)), -> dtype.

    The last block in each dimension may be partial: scales are expanded and then cut to (N, K), never dropped
    (DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``).
    """
    n, k = weight.shape
    scales = scale_inv.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (weight.float() * scales).to(dtype)


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
    keep_fp32 = ("mlp.gate.weight", "e_score_correction_bias")
    return {k: v.float() if k.endswith(keep_fp32) else v.to(dtype) for k, v in state.items()}


def load_model(path: Path, config, *, dtype: torch.dtype, device: torch.device, max_positions: int):
    """Build the model without allocating random weights, then assign the checkpoint's.

    Raises:
        RuntimeError: missing or unexpected weights (names listed by torch).
    """
    from metainfer_gen.llm.models.deepseek_v3 import DeepseekV3ForCausalLM, RotaryTables

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, max_positions)
    state = read_state_dict(path, config, dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = RotaryTables(config, max_positions)
    return model.to(device).eval()
