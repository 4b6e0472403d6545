"""metainfer-gen: fast video-diffusion and LLM inference on PCIe-only GPU machines.

Importing the package is cheap: torch, diffusers and the pipelines load on first use
(``from metainfer_gen import pipelines``).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["pipelines", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "pipelines":
        import importlib

        return importlib.import_module("metainfer_gen.pipelines")
    raise AttributeError(f"module 'metainfer_gen' has no attribute {name!r}")
