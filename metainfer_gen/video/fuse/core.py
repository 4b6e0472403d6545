"""Swap fused kernels into a model from outside it, and take them out again.

``fuse_kernels(model)`` walks ``model.named_modules()`` and, for every module whose class has a registered
*fuser*, installs a diffusers ``ModelHook`` named :data:`FUSE_HOOK` that computes the module's forward with the
registered ops (:mod:`metainfer_gen.kernels`), so the model's own code and weights are untouched.
``unfuse_kernels(model)`` removes every such hook, restoring the original forwards. Fusers are looked up by class
name in a registry filled with :func:`register_fuser` (the package registers Wan's blocks, attention, condition
embedder, rotary tables and VAE modules, loaded lazily from :mod:`metainfer_gen.video.fuse.wan` and its siblings).

Hooks compose with other diffusers hooks only when the fuse hook is the innermost, because it computes the forward
itself rather than calling the next one: fuse first, then enable step caches; ``fuse_kernels`` raises if a module
already carries another hook.

Example:
    >>> from metainfer_gen.video.fuse import fuse_kernels, unfuse_kernels   # doctest: +SKIP
    >>> report = fuse_kernels(pipe.transformer)
    >>> report.num_fused, report.skipped
    (12, {})
    >>> unfuse_kernels(pipe.transformer)
    12
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Protocol

__all__ = ["FUSE_HOOK", "FuseKernelsConfig", "FuseReport", "fuse_kernels", "is_fused", "register_fuser",
           "unfuse_kernels"]

FUSE_HOOK = "metainfer_fused_kernels"


@dataclass(frozen=True, slots=True)
class FuseKernelsConfig:
    """Which fused ops to swap in.

    Args:
        adaln: DiT blocks: LayerNorm + modulate and the gated residuals through ``adaln_modulate`` /
            ``gated_residual``.
        qk_norm: attention q/k RMSNorm through ``rms_norm``.
        rope: attention rotary embedding through ``rope``.
        conv3d: video VAEs: Wan's causal 3-D convolutions through ``conv3d`` (oneDNN on the CPU, see
            :mod:`metainfer_gen.kernels.conv`).
        channel_norm: video VAEs: Wan's channels-first RMS norms through ``channel_rms_norm`` (see
            :mod:`metainfer_gen.kernels.channel_norm`).
        upsample: video VAEs: Wan's nearest upsampling in the feature map's dtype through ``upsample_nearest``
            (no float32 round trip; bit-identical, see :mod:`metainfer_gen.kernels.upsample`).
        timestep_embedding: Wan's condition embedder: the per-token timestep MLP once per distinct timestep
            through ``timestep_embedding`` (see :mod:`metainfer_gen.kernels.timestep_embed`).
        rope_table: Wan's rotary position tables built once per token grid, not per call (exact; see
            :mod:`metainfer_gen.video.fuse.wan_rope`).
        strict: passed to every dispatch (None = the ``METAINFER_STRICT_FAST_PATH`` variable).
    """

    adaln: bool = True
    qk_norm: bool = True
    rope: bool = True
    conv3d: bool = True
    channel_norm: bool = True
    upsample: bool = True
    timestep_embedding: bool = True
    rope_table: bool = True
    strict: bool | None = None

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self) if f.name != "strict"):  # every switch
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FuseKernelsConfig.{name} must be a bool; got {getattr(self, name)!r}")
        if self.strict is not None and not isinstance(self.strict, bool):
            raise TypeError(f"FuseKernelsConfig.strict must be a bool or None; got {self.strict!r}")


class Fuser(Protocol):
    def __call__(self, module, name: str, config: FuseKernelsConfig) -> str | None:
        """Install a hook named FUSE_HOOK on ``module`` (or return why this module cannot be fused)."""


@dataclass(slots=True)
class FuseReport:
    """What :func:`fuse_kernels` did: module names fused, and the reason for each one skipped."""

    fused: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def num_fused(self) -> int:
        return len(self.fused)


# class name -> fuser, or "module:function" loaded on first use (keeps diffusers out of import time). Wan's
# fusers are registered by the package (metainfer_gen.video.fuse), so this module knows no model family.
_FUSERS: dict[str, Fuser | str] = {}


def register_fuser(class_name: str, fuser: Fuser | str) -> None:
    """Register ``fuser`` for modules whose class is named ``class_name`` (replacing any previous one).

    Args:
        class_name: ``type(module).__name__`` to match.
        fuser: ``fuser(module, name, config) -> None | reason`` installing a ``ModelHook`` named
            :data:`FUSE_HOOK`, or ``"package.module:function"`` to import lazily.
    """
    if not isinstance(class_name, str) or not class_name:
        raise ValueError(f"class_name must be a non-empty string; got {class_name!r}")
    if not (callable(fuser) or (isinstance(fuser, str) and ":" in fuser)):
        raise TypeError(f"fuser must be callable or 'module:function'; got {fuser!r}")
    _FUSERS[class_name] = fuser


def _resolve(class_name: str) -> Fuser | None:
    fuser = _FUSERS.get(class_name)
    if isinstance(fuser, str):
        module, _, attr = fuser.partition(":")
        fuser = _FUSERS[class_name] = getattr(importlib.import_module(module), attr)
    return fuser


def _hooks(module) -> list[str]:
    registry = getattr(module, "_diffusers_hook", None)
    return list(registry.hooks) if registry is not None else []


def is_fused(model) -> bool:
    """True when any module of ``model`` carries the fuse hook."""
    return any(FUSE_HOOK in _hooks(m) for _, m in model.named_modules())


def fuse_kernels(model, config: FuseKernelsConfig | None = None) -> FuseReport:
    """Install fused-kernel hooks on every module of ``model`` with a registered fuser.

    Args:
        model: a ``torch.nn.Module`` (e.g. ``diffusers.WanTransformer3DModel``; also a single block).
        config: which ops to fuse; default all.
    Returns:
        A :class:`FuseReport`. Modules whose structure a fuser does not recognise are skipped with the reason.
    Raises:
        ValueError: ``model`` is already fused, or a module to fuse already carries another diffusers hook
            (fuse before enabling caches, so the fused forward is the innermost).
        TypeError: ``config`` is not a FuseKernelsConfig.
    Outputs equal the unfused model's to float32 rounding (atol=rtol=1e-5 on a Wan transformer's output in
    float32); in bfloat16 both round once per op, so they agree within a few bf16 ulps.
    """
    config = FuseKernelsConfig() if config is None else config
    if not isinstance(config, FuseKernelsConfig):
        raise TypeError(f"config must be a FuseKernelsConfig; got {type(config).__name__}")
    if is_fused(model):
        raise ValueError("model is already fused; call unfuse_kernels(model) first")
    targets: list[tuple[str, object, Fuser]] = []
    for name, module in model.named_modules():
        fuser = _resolve(type(module).__name__)
        if fuser is None:
            continue
        others = _hooks(module)
        if others:
            raise ValueError(f"{name or type(module).__name__} already has diffusers hooks {others}: apply "
                             f"fuse_kernels before step caches or other hooks (disable them, fuse, re-enable)")
        targets.append((name, module, fuser))
    report = FuseReport()
    for name, module, fuser in targets:
        reason = fuser(module, name, config)
        if reason is None:
            report.fused.append(name)
        else:
            report.skipped[name] = reason
    return report


def unfuse_kernels(model) -> int:
    """Remove every fuse hook from ``model``; returns how many modules were restored (0 if none was fused)."""
    count = 0
    for _, module in model.named_modules():
        if FUSE_HOOK in _hooks(module):
            module._diffusers_hook.remove_hook(FUSE_HOOK, recurse=False)
            count += 1
    return count

