"""State-driven step-cache reuse for video diffusion transformers (diffusers hook pattern).

    from metainfer_gen.video.cache import StepCacheConfig, apply_step_cache, remove_step_cache

Pipelines use it through ``pipe.enable_step_cache("auto" | "fast" | StepCacheConfig(...) | "fbcache" ...)``; the
lossless condition-embedder memo is separate (``apply_embed_memo`` / ``pipe.enable_embed_memo()``).
Names load lazily: importing this package imports neither torch nor diffusers.
"""

from __future__ import annotations

from metainfer_gen._lazy import lazy_exports

_EXPORTS = {
    "StepCacheConfig": "metainfer_gen.video.cache.config",
    "PRESETS": "metainfer_gen.video.cache.config",
    "apply_step_cache": "metainfer_gen.video.cache.apply",
    "remove_step_cache": "metainfer_gen.video.cache.apply",
    "is_step_cache_enabled": "metainfer_gen.video.cache.apply",
    "get_step_cache_stats": "metainfer_gen.video.cache.apply",
    "StepCacheStats": "metainfer_gen.video.cache.stats",
    "StepRecord": "metainfer_gen.video.cache.stats",
    "CachePolicy": "metainfer_gen.video.cache.policy",
    "make_policy": "metainfer_gen.video.cache.policies",
    "policy_names": "metainfer_gen.video.cache.policies",
    "count_block_evaluations": "metainfer_gen.video.cache.counting",
    "apply_embed_memo": "metainfer_gen.video.cache.embed_memo",
    "remove_embed_memo": "metainfer_gen.video.cache.embed_memo",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
