"""LoRA key normalisation: the many file layouts video LoRAs come in, mapped onto one diffusers state dict.

What diffusers' Wan loader lacks, and only that: diffusers' ``WanLoraLoaderMixin.lora_state_dict`` converts the
original-Wan layout (``diffusion_model.`` prefix) and musubi/kohya's (``lora_unet_``), but its converters
(``_convert_non_diffusers_wan_lora_to_diffusers``, ``_convert_musubi_wan_lora_to_diffusers`` in diffusers 0.42)
raise on the inputs users actually have: a kohya LoRA covering only some modules (KeyError: every module of every
block is popped), any key they do not know (ValueError), mixed ``_``/``.`` separators. Here every key is parsed on
its own, matched against the target transformer's module names (diffusers names, or original-Wan names for Wan
transformers), checked for shape, and either kept or reported as skipped with the reason. What is kept goes to
diffusers' ``load_lora_weights`` (and so to peft) in diffusers' own ``transformer.<module>.lora_A/B.weight`` form.

Plain Python over a ``{name: tensor}`` dict (no device work, no model forward): unit-tested on the CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

# Original-Wan module names (``diffusion_model.`` / ``lora_unet_`` files) -> diffusers names, as diffusers'
# ``_convert_non_diffusers_wan_lora_to_diffusers`` maps them (diffusers 0.42, loaders/lora_conversion_utils.py).
WAN_BLOCK_MODULES = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0", "cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj",
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}
WAN_GLOBAL_MODULES = {
    "head.head": "proj_out", "time_projection.1": "condition_embedder.time_proj",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
}
# Wrappers trainers put before the module name (flattened: separators as "_"); tried longest first, and also
# not at all, so a model whose own names start with "transformer_" (HunyuanVideo) still matches.
_PREFIXES = ("base_model_model_", "model_diffusion_model_", "diffusion_model_", "lora_transformer_", "lora_unet_",
             "transformer_", "unet_")
_PART = re.compile(r"^(?P<module>.+?)[._](?P<part>lora_down|lora_up|lora_A|lora_B|lora[._]down|lora[._]up)"
                   r"(?:[._]default(?:_\d+)?)?[._](?P<param>weight|bias)$")
_SCALAR = re.compile(r"^(?P<module>.+?)[._](?P<part>alpha|diff_b)$")
_DOWN = ("lora_down", "lora_A", "lora.down")
_UP = ("lora_up", "lora_B", "lora.up")


def _flat(name: str) -> str:
    return re.sub(r"[._]+", "_", name)


@dataclass(slots=True)
class _Module:
    """The LoRA parts found for one target module."""

    keys: list[str] = field(default_factory=list)
    down: torch.Tensor | None = None  # (rank, in_features)
    up: torch.Tensor | None = None  # (out_features, rank)
    bias: torch.Tensor | None = None  # (out_features,): lora_B.bias / original-Wan diff_b
    alpha: float | None = None


def module_vocabulary(transformer: torch.nn.Module) -> dict[str, tuple[str, torch.nn.Linear]]:
    """``{flattened name: (diffusers module name, its nn.Linear)}`` for every Linear of ``transformer``.

    Names already wrapped by peft (``...to_q.base_layer``) count as the module itself. For Wan transformers the
    original-Wan names (``blocks_3_self_attn_q``) are added, pointing at the same modules.
    """
    linears: dict[str, torch.nn.Linear] = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name and "lora_magnitude" not in name:
            linears[name.removesuffix(".base_layer")] = module
    vocabulary = {_flat(name): (name, module) for name, module in linears.items()}
    blocks = getattr(transformer, "blocks", None)
    if type(transformer).__name__.startswith("Wan") and isinstance(blocks, torch.nn.ModuleList):
        pairs = [(f"blocks.{i}.{orig}", f"blocks.{i}.{ours}") for i in range(len(blocks))
                 for orig, ours in WAN_BLOCK_MODULES.items()] + list(WAN_GLOBAL_MODULES.items())
        vocabulary.update({_flat(orig): (ours, linears[ours]) for orig, ours in pairs if ours in linears})
    return vocabulary


def _lookup(module_key: str, vocabulary: dict) -> tuple[str, torch.nn.Linear] | None:
    flat = _flat(module_key)
    candidates = [flat] + [flat[len(p):] for p in _PREFIXES if flat.startswith(p)]
    for _ in range(2):  # wrappers can nest ("base_model.model.transformer.")
        candidates += [c[len(p):] for c in candidates for p in _PREFIXES if c.startswith(p)]
    return next((vocabulary[c] for c in candidates if c in vocabulary), None)


def non_finite_keys(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [k for k, v in state_dict.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def normalise_lora(state_dict: dict[str, torch.Tensor], transformer: torch.nn.Module,
                   default_alpha: float | None = None) -> tuple[dict[str, torch.Tensor], list[str], dict[str, str]]:
    """Map a LoRA state dict in any supported layout onto ``transformer``'s modules.

    Args:
        state_dict: tensors keyed as diffusers (``transformer.blocks.0.attn1.to_q.lora_A.weight``), peft
            (``base_model.model.blocks.0.attn1.to_q.lora_A.weight``), original Wan
            (``diffusion_model.blocks.0.self_attn.q.lora_down.weight`` + ``.alpha`` + ``.diff_b``), kohya/musubi
            (``lora_unet_blocks_0_self_attn_q.lora_down.weight`` + ``.alpha``), or any mix of ``_``/``.``.
        transformer: the model the LoRA is for (a diffusers transformer, possibly already holding adapters).
        default_alpha: alpha of modules that carry none (a peft ``adapter_config.json``'s ``lora_alpha``);
            None means alpha = rank (scale 1), diffusers' convention.
    Returns:
        ``(diffusers_state_dict, modules, skipped)``: float32 ``transformer.<module>.lora_A.weight`` (rank, in)
        with the scale ``alpha / rank`` folded in, ``lora_B.weight`` (out, rank), optional ``lora_B.bias`` (out,);
        the diffusers names of the covered modules, sorted; ``{key: reason}`` of every key not used.
    """
    vocabulary = module_vocabulary(transformer)
    found: dict[str, _Module] = {}
    skipped: dict[str, str] = {}
    for key, value in state_dict.items():
        match = _PART.match(key) or _SCALAR.match(key)
        if match is None:
            skipped[key] = "not a LoRA tensor (lora_A/lora_B/lora_down/lora_up/alpha/diff_b)"
            continue
        target = _lookup(match["module"], vocabulary)
        if target is None:
            skipped[key] = "no module of this name in the model"
            continue
        entry = found.setdefault(target[0], _Module())
        entry.keys.append(key)
        part, param = match["part"], match.groupdict().get("param")
        if part == "alpha":
            entry.alpha = float(value.float().reshape(-1)[0])
        elif part == "diff_b" or (part in _UP and param == "bias"):
            entry.bias = value
        elif param == "bias":
            entry.keys.pop()
            skipped[key] = "a bias on lora_A/lora_down has no meaning in LoRA"
        elif part in _DOWN:
            entry.down = value
        else:
            entry.up = value
    converted: dict[str, torch.Tensor] = {}
    for name, entry in found.items():
        reason = _check(entry, vocabulary[_flat(name)][1])
        if reason:
            skipped.update({k: reason for k in entry.keys})
            continue
        rank = entry.down.shape[0]
        alpha = entry.alpha if entry.alpha is not None else default_alpha
        scale = 1.0 if alpha is None else alpha / rank
        converted[f"transformer.{name}.lora_A.weight"] = entry.down.float() * scale
        converted[f"transformer.{name}.lora_B.weight"] = entry.up.float()
        if entry.bias is not None:
            converted[f"transformer.{name}.lora_B.bias"] = entry.bias.float()
    modules = sorted(k[len("transformer."):-len(".lora_A.weight")] for k in converted if k.endswith("lora_A.weight"))
    return converted, modules, skipped


def _check(entry: _Module, linear: torch.nn.Linear) -> str | None:
    """Why this module's parts cannot load (None when they can)."""
    if entry.down is None or entry.up is None:
        return f"{'lora_up/lora_B' if entry.down is not None else 'lora_down/lora_A'} of the same module is missing"
    if entry.down.dim() != 2 or entry.up.dim() != 2 or entry.down.shape[0] != entry.up.shape[1]:
        return f"lora_A {tuple(entry.down.shape)} and lora_B {tuple(entry.up.shape)} are not a rank-r pair"
    if entry.down.shape[1] != linear.in_features or entry.up.shape[0] != linear.out_features:
        return (f"shape {tuple(entry.up.shape[:1]) + tuple(entry.down.shape[1:])} does not fit the model's "
                f"{linear.out_features}x{linear.in_features} layer")
    if entry.bias is not None and tuple(entry.bias.shape) != (linear.out_features,):
        return f"bias {tuple(entry.bias.shape)} does not fit {linear.out_features} outputs"
    return None
