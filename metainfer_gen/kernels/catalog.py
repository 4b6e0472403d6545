"""The built-in kernel modules, and ops looked up by name with those loaded first.

Kernel modules register their ops with :func:`metainfer_gen.kernels.registry.register_op` when imported; this
module imports them on the first lookup, so the registry itself depends on no kernel (later kernels append their
module to :data:`BUILTIN_KERNEL_MODULES` or register themselves).
"""

from __future__ import annotations

import importlib

from metainfer_gen.kernels.registry import _OPS, Op

__all__ = ["BUILTIN_KERNEL_MODULES", "get_op", "load_builtin_ops", "registered_ops"]

BUILTIN_KERNEL_MODULES: list[str] = [
    "metainfer_gen.kernels.norm",
    "metainfer_gen.kernels.rotary",
    "metainfer_gen.kernels.adaln",
    "metainfer_gen.kernels.kv_cache",
    "metainfer_gen.kernels.fp8_quant",
    "metainfer_gen.kernels.fp8_gemm",
    "metainfer_gen.kernels.indexer",
    "metainfer_gen.kernels.sparse_attention",
    "metainfer_gen.kernels.paged_mla",
    "metainfer_gen.kernels.block_attention",
    "metainfer_gen.kernels.gemm",
    "metainfer_gen.kernels.moe",
    "metainfer_gen.kernels.conv",
    "metainfer_gen.kernels.channel_norm",
    "metainfer_gen.kernels.upsample",
    "metainfer_gen.kernels.timestep_embed",
]


def load_builtin_ops() -> None:
    """Import every module in :data:`BUILTIN_KERNEL_MODULES` (each registers its ops on import)."""
    for module in BUILTIN_KERNEL_MODULES:
        importlib.import_module(module)


def get_op(name: str) -> Op:
    """The op called ``name``, loading the built-in kernels first.

    Raises:
        KeyError: no such op (the message lists the registered ones).
    """
    if name not in _OPS:
        load_builtin_ops()
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"no op {name!r}; registered: {sorted(_OPS)}") from None


def registered_ops() -> list[Op]:
    """All ops, built-ins loaded, in registration order."""
    load_builtin_ops()
    return list(_OPS.values())
