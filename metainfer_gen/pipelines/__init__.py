"""User-facing pipeline objects: ``from metainfer_gen import pipelines``.

Classes load lazily so that importing this module costs nothing until a pipeline is used.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "TextToVideoPipeline": "metainfer_gen.pipelines.text_to_video",
    "ImageToVideoPipeline": "metainfer_gen.pipelines.image_to_video",
    "VideoOutput": "metainfer_gen.video.output",
    "TextGenerationPipeline": "metainfer_gen.pipelines.text_generation",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'metainfer_gen.pipelines' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
