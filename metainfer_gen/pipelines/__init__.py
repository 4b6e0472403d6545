"""User-facing pipeline objects: ``from metainfer_gen import pipelines``.

Classes load lazily so that importing this module costs nothing until a pipeline is used.
"""

from __future__ import annotations

from metainfer_gen._lazy import lazy_exports

_EXPORTS = {
    "TextToVideoPipeline": "metainfer_gen.pipelines.text_to_video",
    "ImageToVideoPipeline": "metainfer_gen.pipelines.image_to_video",
    "VideoOutput": "metainfer_gen.video.output",
    "TextGenerationPipeline": "metainfer_gen.pipelines.text_generation",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
