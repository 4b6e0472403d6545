"""One app for both families: the LLM routes (when an LLM is served), the ``/v1/videos`` routes (when a video
model is), one ``/health`` and one ``/metrics`` covering both, one API key."""

from __future__ import annotations

import asyncio

from metainfer_gen.serve.info_routes import add_info_routes, served_model
from metainfer_gen.serve.openapi_docs import common_operations, install_schema, llm_operations
from metainfer_gen.serve.openapi_video import video_operations
from metainfer_gen.serve.video.metrics import VideoCollector
from metainfer_gen.serve.video.routes import add_video_routes


def serving_app(front, llm_metrics, settings, video=None):
    """The FastAPI app.

    Args:
        front / llm_metrics: the LLM's :class:`~metainfer_gen.serve.async_engine.AsyncLLMEngine` and
            :class:`~metainfer_gen.serve.metrics.ServerMetrics`, or None for a video-only server.
        settings: the :class:`~metainfer_gen.serve.app.AppSettings` (API key, body limit; the LLM's name).
        video: the :class:`~.service.VideoService`, or None for an LLM-only server.
    Raises:
        ValueError: neither an LLM nor a video model.
    """
    from metainfer_gen.serve.app import build_app, new_app

    if front is None and video is None:
        raise ValueError("nothing to serve: give an LLM, a video model, or both")

    def video_health() -> str | None:  # an API-only node (no workers of its own) is healthy while it answers
        if video is None or video.config.num_workers == 0:
            return None
        if not video.pool.supervising:
            return "the video worker supervisor has stopped: dead workers are not restarted"
        if video.num_alive_workers == 0:
            return "no video worker process is running"
        return None

    if front is not None:
        app = build_app(front, llm_metrics, settings, extra_health=video_health)
        registry = llm_metrics.registry
    else:
        from fastapi.responses import JSONResponse, Response
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        from metainfer_gen.serve.errors import error_body

        app, registry = new_app(), CollectorRegistry()

        @app.get("/health")
        async def health():
            problem = video_health()
            if problem:
                return JSONResponse(error_body(problem, "service_unavailable"), status_code=503)
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():  # off the loop: the collector reads the job store
            return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    operations = common_operations()
    if front is not None:
        operations.update(llm_operations(settings.model_name, front.engine.model.config.vocab_size))
    if video is not None:
        registry.register(VideoCollector(video))
        add_video_routes(app, video, settings.api_key, settings.max_body_bytes, settings.max_queued_videos)
        app.state.models.append(served_model(video.model_name, "video"))
        operations.update(video_operations(video.model_name))
    add_info_routes(app, settings.api_key)  # last: its HEAD routes cover every GET route above
    install_schema(app, operations)
    return app
