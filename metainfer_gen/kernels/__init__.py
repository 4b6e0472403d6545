"""Fused kernels behind one registry, with an audit of which path ran and why faster ones were refused.

    from metainfer_gen import kernels

    y = kernels.rms_norm(x, weight, eps=1e-6)          # Triton on GPU, compiled or eager torch on CPU
    with kernels.audit() as report:                     # what ran inside the block, counted per call site
        out = pipe("a red circle moving right")
    print(report.summary())

The ops are model-agnostic: swapping them into a model's modules lives with the model family
(:mod:`metainfer_gen.video.fuse` for diffusers' Wan). Importing this package is cheap: the kernel files (which
import torch, never triton) load on first attribute access, and Triton kernels are built on their first launch.
"""

from __future__ import annotations

from metainfer_gen._lazy import lazy_exports

_EXPORTS = {
    "rms_norm": "metainfer_gen.kernels.norm",
    "fused_add_rms_norm": "metainfer_gen.kernels.norm",
    "rope": "metainfer_gen.kernels.rotary",
    "adaln_modulate": "metainfer_gen.kernels.adaln",
    "gated_residual": "metainfer_gen.kernels.adaln",
    "compute_slot_mapping": "metainfer_gen.kernels.kv_cache",
    "positions_from_lengths": "metainfer_gen.kernels.kv_cache",
    "store_kv_cache": "metainfer_gen.kernels.kv_cache",
    "fp8_act_quant": "metainfer_gen.kernels.fp8_quant",
    "fp8_weight_dequant": "metainfer_gen.kernels.fp8_quant",
    "quantize_fp8_weight": "metainfer_gen.kernels.fp8_quant",
    "fp8_block_gemm": "metainfer_gen.kernels.fp8_gemm",
    "fp8_linear": "metainfer_gen.kernels.fp8_gemm",
    "indexer_topk": "metainfer_gen.kernels.indexer",
    "sparse_mla": "metainfer_gen.kernels.sparse_attention",
    "paged_mla_decode": "metainfer_gen.kernels.paged_mla",
    "moe_experts": "metainfer_gen.kernels.moe",
    "linear": "metainfer_gen.kernels.gemm",
    "conv3d": "metainfer_gen.kernels.conv",
    "channel_rms_norm": "metainfer_gen.kernels.channel_norm",
    "upsample_nearest": "metainfer_gen.kernels.upsample",
    "timestep_embedding": "metainfer_gen.kernels.timestep_embed",
    "audit": "metainfer_gen.kernels.audit_log",
    "global_audit": "metainfer_gen.kernels.audit_log",
    "Audit": "metainfer_gen.kernels.audit_log",
    "FastPathRefused": "metainfer_gen.kernels.registry",
    "Op": "metainfer_gen.kernels.registry",
    "get_op": "metainfer_gen.kernels.catalog",
    "register_op": "metainfer_gen.kernels.registry",
    "registered_ops": "metainfer_gen.kernels.catalog",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
