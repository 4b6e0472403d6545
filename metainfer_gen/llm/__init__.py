"""LLM front end: a paged-KV, continuously batching engine for DeepSeek-style (MLA, MoE) models.

    from metainfer_gen.llm import LLMEngine, EngineConfig, SamplingParams
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLMEngine": "metainfer_gen.llm.engine",
    "RequestRejected": "metainfer_gen.llm.engine",
    "EngineConfig": "metainfer_gen.llm.config",
    "SamplingParams": "metainfer_gen.llm.sequence",
    "RequestOutput": "metainfer_gen.llm.outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
