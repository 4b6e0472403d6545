"""LLM front end: a paged-KV, continuously batching engine for DeepSeek-style (MLA, MoE) models.

    from metainfer_gen.llm import LLMEngine, EngineConfig, SamplingParams
"""

from __future__ import annotations

from metainfer_gen._lazy import lazy_exports

_EXPORTS = {
    "LLMEngine": "metainfer_gen.llm.engine",
    "RequestRejected": "metainfer_gen.llm.engine",
    "EngineConfig": "metainfer_gen.llm.config",
    "SamplingParams": "metainfer_gen.llm.sequence",
    "RequestOutput": "metainfer_gen.llm.outputs",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
