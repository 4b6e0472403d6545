"""Fused kernels swapped into diffusers video models from outside them (removable hooks), Wan's modules built in.

    from metainfer_gen.video.fuse import fuse_kernels, unfuse_kernels

    report = fuse_kernels(pipe.diffusers_pipeline.transformer)   # adaLN, q/k norm, rope, tables through kernels
    unfuse_kernels(pipe.diffusers_pipeline.transformer)

The ops themselves are model-agnostic and live in :mod:`metainfer_gen.kernels`; this package knows Wan's module
contracts (:mod:`.wan`, :mod:`.wan_embedder`, :mod:`.wan_rope`, :mod:`.wan_vae`), registered here by class
name; other families call :func:`register_fuser`. The fusers and diffusers load on the first fuse.
"""

from __future__ import annotations

from metainfer_gen._lazy import lazy_exports
from metainfer_gen.video.fuse.core import register_fuser

# diffusers' Wan modules (class name) -> their fuser, imported on the first fuse_kernels that meets one.
WAN_FUSERS = {
    "WanTransformerBlock": "metainfer_gen.video.fuse.wan:fuse_wan_block",
    "WanAttention": "metainfer_gen.video.fuse.wan:fuse_wan_attention",
    "WanTimeTextImageEmbedding": "metainfer_gen.video.fuse.wan_embedder:fuse_wan_condition_embedder",
    "WanCausalConv3d": "metainfer_gen.video.fuse.wan_vae:fuse_wan_causal_conv3d",
    "WanRMS_norm": "metainfer_gen.video.fuse.wan_vae:fuse_wan_rms_norm",
    "WanUpsample": "metainfer_gen.video.fuse.wan_vae:fuse_wan_upsample",
    "WanRotaryPosEmbed": "metainfer_gen.video.fuse.wan_rope:fuse_wan_rotary_table",
}
for _class_name, _fuser in WAN_FUSERS.items():
    register_fuser(_class_name, _fuser)

_EXPORTS = {
    "FUSE_HOOK": "metainfer_gen.video.fuse.core",
    "FuseKernelsConfig": "metainfer_gen.video.fuse.core",
    "FuseReport": "metainfer_gen.video.fuse.core",
    "fuse_kernels": "metainfer_gen.video.fuse.core",
    "unfuse_kernels": "metainfer_gen.video.fuse.core",
    "register_fuser": "metainfer_gen.video.fuse.core",
    "is_fused": "metainfer_gen.video.fuse.core",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
