"""One small LoRA written in the five layouts users bring (test helper, independent of ``video/lora_keys.py``).

The LoRA covers some modules of the tiny Wan transformer (partial on purpose), with rank 4 and alpha 2, so every
layout must apply the same ``alpha / rank`` scale for the outputs to agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK, ALPHA = 4, 2.0
# diffusers module (inside blocks.<i>) -> original Wan name; a subset of the blocks' linears.
ORIGINAL = {"attn1.to_q": "self_attn.q", "attn1.to_out.0": "self_attn.o", "attn2.to_v": "cross_attn.v",
            "ffn.net.0.proj": "ffn.0"}
FORMATS = ("diffusers", "peft", "wan", "kohya", "mixed")


def make_lora(transformer, seed: int = 0, scale: float = 0.3) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{diffusers module name: (down (r, in), up (out, r))}`` over both blocks of the tiny transformer."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for block in range(len(transformer.blocks)):
        for name in ORIGINAL:
            module = transformer.get_submodule(f"blocks.{block}.{name}")
            down = torch.randn(RANK, module.in_features, generator=generator) * scale
            up = torch.randn(module.out_features, RANK, generator=generator) * scale
            lora[f"blocks.{block}.{name}"] = (down, up)
    return lora


def _original(name: str, separator: str = ".") -> str:
    _, block, rest = name.split(".", 2)
    return f"blocks{separator}{block}{separator}{ORIGINAL[rest]}"


def state_dict(lora, fmt: str) -> dict[str, torch.Tensor]:
    """The LoRA's tensors keyed as layout ``fmt`` (alpha folded in where the layout has no alpha)."""
    out: dict[str, torch.Tensor] = {}
    for index, (name, (down, up)) in enumerate(lora.items()):
        alpha = torch.tensor(ALPHA)
        if fmt == "diffusers":
            out[f"transformer.{name}.lora_A.weight"] = down * (ALPHA / RANK)
            out[f"transformer.{name}.lora_B.weight"] = up
        elif fmt == "peft":  # alpha lives in adapter_config.json
            out[f"base_model.model.{name}.lora_A.weight"] = down
            out[f"base_model.model.{name}.lora_B.weight"] = up
        elif fmt == "wan":
            key = f"diffusion_model.{_original(name)}"
            out.update({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": alpha})
        elif fmt == "kohya":
            key = "lora_unet_" + _original(name).replace(".", "_")
            out.update({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": alpha})
        elif fmt == "mixed":  # alternate the two conventions per module, and mix separators inside names
            key = (f"diffusion_model.{_original(name, '_')}" if index % 2 else
                   "lora_unet_" + _original(name).replace("_", "."))
            out.update({f"{key}.lora_down.weight": down, f"{key}_lora_up.weight": up, f"{key}.alpha": alpha})
        else:
            raise ValueError(fmt)
    return out


def write(lora, fmt: str, folder: Path) -> Path:
    """Save the LoRA in layout ``fmt`` under ``folder``; a peft folder (with adapter_config.json) for "peft"."""
    tensors = {k: v.contiguous() for k, v in state_dict(lora, fmt).items()}
    if fmt == "peft":
        path = folder / "peft_adapter"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({"r": RANK, "lora_alpha": ALPHA, "peft_type": "LORA"}))
        return path
    path = folder / f"{fmt}.safetensors"
    save_file(tensors, str(path))
    return path
