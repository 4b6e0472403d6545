"""What makes a dispatch decision repeatable: input signatures, the machine state, and call-site names.

:meth:`metainfer_gen.kernels.registry.Op.dispatch` runs on every call of a small op (an LLM decode step makes a
few dozen), and walking the ``supports`` predicates costs tens of microseconds per call (the Triton status, dtype
and stride checks, string formatting of the reasons). The predicates are pure functions of

- each tensor's shape, strides, dtype, device, ``requires_grad`` and storage alignment (the word-copy KV store
  refuses rows that do not start on a 4-byte boundary);
- the other arguments' values (ints, floats, strings, dtypes);
- the autograd mode (Triton kernels have no backward);
- the machine: :func:`metainfer_gen.platform.capabilities` (overridable in tests), whether triton is installed,
  ``TRITON_INTERPRET`` and ``METAINFER_CPU_KERNELS`` (the C++ CPU kernels' switch).

so a decision is cached under :func:`signature_key` of the inputs, and the cache is dropped whenever
:func:`environment` changes. The one stateful predicate, :class:`~metainfer_gen.kernels.common.CompiledPath`'s
recompile limit, only ever turns an unseen signature from accepted to refused, and a signature it accepted is
compiled on that call, so a cached decision stays what a fresh walk would return. Inputs of other types (tensor
subclasses, arbitrary objects) get no key: those calls walk the predicates every time, as before.

:func:`call_site` names the caller for the audit (``"file.py:123 (function)"``) from a per-code-object cache,
instead of formatting the frame on every call.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from metainfer_gen import platform
from metainfer_gen.kernels.common import compiles_frozen
from metainfer_gen.kernels.cpu_build import DISABLE_ENV

__all__ = ["MAX_DECISIONS", "call_site", "environment", "signature_key"]

# Bound per op: an LLM step's token count varies, so shapes keep coming; past this the op's cache restarts.
MAX_DECISIONS = 4096

# Storage alignment the key distinguishes (the strictest predicate checks 4-byte words; 16 leaves room).
_ALIGN = 16

_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
_SCALARS = (int, float, bool, str, type(None), torch.dtype)


def signature_key(args: tuple, kwargs: dict) -> tuple | None:
    """A hashable key of everything the built-in ``supports`` predicates read from the inputs, or None when an
    argument's type is not understood (then the decision is not cached)."""
    parts: list[Any] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for value in args:
        part = _part(value)
        if part is None:
            return None
        parts.append(part)
    for name in sorted(kwargs):
        part = _part(kwargs[name])
        if part is None:
            return None
        parts.append((name, part))
    return tuple(parts)


def _part(value: Any) -> tuple | None:
    kind = type(value)
    if kind in _PLAIN_TENSORS:
        return (value.shape, value.stride(), value.dtype, value.device, value.requires_grad,
                value.data_ptr() % _ALIGN)
    if kind in _SCALARS:
        return (kind, value)
    if kind is tuple:  # small tuples of scalars (convolution stride, padding, ...)
        parts = tuple(_part(v) for v in value)
        return None if any(p is None for p in parts) else (tuple, parts)
    return None


def environment() -> tuple:
    """The machine state the predicates read; a cached decision is valid only while this compares equal.

    ``triton_installed()`` is called (its answer is cached in :mod:`~metainfer_gen.platform`, so this is cheap):
    keying on the function object would keep a decision made before triton was installed, or removed. Inside
    :func:`~metainfer_gen.kernels.common.no_new_compiles` compiled paths refuse new shapes, so that is state too.
    """
    return (os.environ.get("TRITON_INTERPRET"), os.environ.get(DISABLE_ENV), platform.capabilities(),
            platform.triton_installed(), compiles_frozen())


# id(code object) -> (code object, {line: site}); the code object is kept so that an id is never reused.
_SITES: dict[int, tuple[Any, dict[int, str]]] = {}


def call_site(stacklevel: int) -> str:
    """``"file.py:line (function)"`` of the frame ``stacklevel + 1`` up from the caller of this function."""
    frame = sys._getframe(stacklevel + 1)
    code, line = frame.f_code, frame.f_lineno
    entry = _SITES.get(id(code))
    if entry is None or entry[0] is not code:
        entry = _SITES[id(code)] = (code, {})
    site = entry[1].get(line)
    if site is None:
        site = entry[1][line] = f"{os.path.basename(code.co_filename)}:{line} ({code.co_name})"
    return site
