"""Lazy package exports (PEP 562): a package names what it exports and where it lives; the defining module is
imported on first access, so ``import metainfer_gen.<package>`` stays cheap (no torch, diffusers or triton)."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that resolves ``name`` from the module ``exports[name]``.

    The value is stored on the package after the first lookup, so later accesses (hot paths) skip this hook.

    Raises (from the returned function):
        AttributeError: ``name`` is not exported.
    """

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
