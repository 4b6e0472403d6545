"""Tiny random DeepSeek-V4 (``deepseek_v4``) models from transformers 5.24, for the V4 building blocks' tests."""

from __future__ import annotations

import json
import re

import torch

# Every layer type, both MLP router types, small compression rates so a short prompt closes many windows.
V4 = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=32,
          o_lora_rank=16, o_groups=2, hc_mult=2, index_topk=4, index_head_dim=16, index_n_heads=4,
          intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, sliding_window=16,
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          mlp_layer_types=["hash_moe", "moe", "moe"])


def make_hf_v4_model(seed: int = 0, **overrides):
    """A transformers ``DeepseekV4ForCausalLM`` in float32, every parameter drawn at random (position biases and
    norm weights included, so no term is a no-op)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("deepseek_v4", bos_token_id=None, eos_token_id=None, **{**V4, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("position_bias", "norm.weight", "sinks", "base", "scale")):
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
    return model


def compress_tables(config, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, rope_dim / 2) float32 cos/sin of the "compress" rope, from transformers' own rotary."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    cos, sin = DeepseekV4RotaryEmbedding(config)(torch.zeros(1), torch.arange(num_positions)[None], "compress")
    return cos[0].float(), sin[0].float()


# The tensors DeepSeek's V4 releases store in FP8 blocks (saved names): attention and indexer query projections,
# shared and routed experts; the compressors' wkv/wgate, weights_proj, routers, embedding and head stay dense.
V4_FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.indexer\.wq_b|\.shared_experts\.w[123]"
                    r"|\.experts\.\d+\.w[123])\.weight$")


def quantise_block(weight: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (e4m3 weight, one scale per 128x128 block): float32 amax / 448, or with ``ue8m0`` the next power
    of two above it stored as float8_e8m0fnu (DeepSeek-V4's ``scale_fmt``; no value clips)."""
    from metainfer_gen.kernels.fp8_quant import FP8_BLOCK, quantize_fp8_weight

    q, scale = quantize_fp8_weight(weight)
    if not ue8m0:
        return q, scale
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    n, k = weight.shape
    wide = scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return (weight.float() / wide).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


# e2m1 codes 0..15 (bit 3 the sign); routed experts, FP4 in DeepSeek-V4-Flash
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_ROUTED = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def quantise_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (int8 (N, K/2): e2m1 codes two a byte, the even element in the low nibble; float8_e8m0fnu
    (N, K/32): a power of two per 32 values of a row, so the group's largest value maps to at most 6), rounded to
    the nearest e2m1 value, as DeepSeek-V4-Flash stores its routed experts. K must be a multiple of 32."""
    n, k = weight.shape
    groups = weight.float().view(n, k // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6)))
    x = groups / scale[..., None]
    code = (x.abs()[..., None] - torch.tensor(E2M1[:8])).abs().argmin(-1) | ((x < 0).long() << 3)
    code = code.view(n, k).to(torch.uint8)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8), scale.to(torch.float8_e8m0fnu)


def dequantise_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 (N, K) values of :func:`quantise_fp4`'s output."""
    codes = packed.view(torch.uint8)
    values = torch.tensor(E2M1)[torch.stack([codes & 15, codes >> 4], -1).flatten(-2).long()]
    return values * scale.float().repeat_interleave(32, -1)


def _deepseek_name(name: str) -> str:
    """transformers' saved name -> DeepSeek's release name (``layers.N.*``, ``embed``, ``norm``, ``hc_head_*``)."""
    for old, new in (("model.layers.", "layers."), ("model.embed_tokens.", "embed."), ("model.norm.", "norm."),
                     ("model.hc_head.hc_", "hc_head_")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def save_v4_fp8_checkpoint(model, fp8_path, grid_path, scale_suffix: str = "scale", ue8m0: bool = False,
                           fp4_experts: bool = False, deepseek_names: bool = False) -> None:
    """Save ``model`` twice: at ``fp8_path`` as DeepSeek ships V4 in FP8 (:data:`V4_FP8` tensors e4m3 with their
    block scales named ``<module>.<scale_suffix>``, config ``quantization_config`` fp8 [128, 128], ``scale_fmt``
    ue8m0 with ``ue8m0``; with ``fp4_experts`` the routed experts in FP4 (:func:`quantise_fp4`, ``expert_dtype``
    fp4), as DeepSeek-V4-Flash; with ``deepseek_names`` the release's names, ``layers.N.attn.wq_a.scale`` ...),
    and at ``grid_path`` densely with exactly the dequantised values (the reference)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from metainfer_gen.kernels.fp8_quant import dequantize_fp8_weight_reference

    fp8_path, grid_path = Path(fp8_path), Path(grid_path)
    model.save_pretrained(fp8_path)
    model.save_pretrained(grid_path)
    (file,) = fp8_path.glob("*.safetensors")
    fp8 = load_file(file)
    grid = dict(fp8)
    for name in [n for n in fp8 if V4_FP8.search(n)]:
        if fp4_experts and _ROUTED.search(name):
            q, scale = quantise_fp4(fp8[name])
            grid[name] = dequantise_fp4(q, scale)
        else:
            q, scale = quantise_block(fp8[name], ue8m0)
            grid[name] = dequantize_fp8_weight_reference(q, scale.float())
        fp8[name], fp8[name.removesuffix("weight") + scale_suffix] = q, scale
    if deepseek_names:
        fp8 = {_deepseek_name(name): tensor for name, tensor in fp8.items()}
    save_file(fp8, file, metadata={"format": "pt"})
    save_file(grid, grid_path / file.name, metadata={"format": "pt"})
    config = json.loads((fp8_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128], **({"scale_fmt": "ue8m0"} if ue8m0 else {}),
                                     **({"expert_dtype": "fp4"} if fp4_experts else {})}
    (fp8_path / "config.json").write_text(json.dumps(config))
