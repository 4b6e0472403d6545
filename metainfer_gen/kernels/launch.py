"""Kernel launches that can be recorded instead of run, and the GPU architecture the launch configs are chosen for.

Every Triton wrapper launches through :func:`launch`. Inside :func:`record_launches` nothing runs: each launch is
kept as a :class:`KernelLaunch` (kernel, grid, arguments, meta-parameters), so that
``benchmarks/triton_aot.py`` can call the real wrappers on ``device="meta"`` tensors and compile exactly the
configurations they would pick for a GPU architecture this machine does not have. :func:`target_arch` is what the
wrappers ask when a config depends on the architecture (the recorded one, else the tensor's CUDA device).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

__all__ = ["KernelLaunch", "launch", "record_launches", "target_arch"]

_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar("kernel_launch_recorder", default=None)
_ARCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("kernel_target_arch", default=None)


@dataclass(frozen=True)
class KernelLaunch:
    """One launch: ``kernel[grid](*args, **meta)``; ``meta`` holds the constexprs and ``num_warps``/``num_stages``."""

    kernel: Any  # triton.JITFunction
    grid: tuple[int, ...]
    args: tuple
    meta: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, or recorded when inside :func:`record_launches`."""
    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.append(KernelLaunch(kernel, tuple(grid), args, dict(meta)))
        return
    kernel[grid](*args, **meta)


@contextlib.contextmanager
def record_launches(arch: int) -> Iterator[list[KernelLaunch]]:
    """Record launches instead of running them, with configs chosen for sm_``arch`` (80, 89, 90, 120...)."""
    launches: list[KernelLaunch] = []
    token, arch_token = _RECORDER.set(launches), _ARCH.set(int(arch))
    try:
        yield launches
    finally:
        _RECORDER.reset(token)
        _ARCH.reset(arch_token)


def target_arch(device: torch.device | str) -> int | None:
    """The sm number configs are chosen for: the recorded arch, else ``device``'s capability (90), else None."""
    arch = _ARCH.get()
    if arch is not None:
        return arch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor
