"""The ``/v1/videos`` routes (OpenAI's video API, with vLLM-Omni's ``/sync`` and fields), added to the server's app.

- ``POST /v1/videos``: JSON, or ``multipart/form-data`` with an ``input_reference`` image (image-to-video; the
  ``openai`` SDK always sends multipart); answers the queued job.
- ``POST /v1/videos/sync``: the same, answered with the MP4 once rendered (a client that leaves cancels it).
- ``GET /v1/videos/{id}``, ``GET /v1/videos`` (newest first; ``limit``, ``after``), ``GET /v1/videos/{id}/content``
  (``video/mp4``; 404 until completed), ``DELETE /v1/videos/{id}``.
"""

# No ``from __future__ import annotations``: FastAPI reads the ``Request`` annotations at definition time.
import asyncio
import contextlib

from metainfer_gen.serve.errors import APIError, bad_request, redact_paths
from metainfer_gen.serve.http_io import check_api_key, read_body, read_json, refuse_query
from metainfer_gen.serve.json_body import check_form_text
from metainfer_gen.serve.video.jobs import Job, JobStatus
from metainfer_gen.serve.video.request import FIELDS, VideoRequest

POLL_AFTER_MS = 250  # the openai SDK's ``poll`` waits this long between retrievals (header openai-poll-after-ms)
SYNC_POLL_S = 0.05
MAX_LIST = 100


def video_object(job: Job, model_name: str) -> dict:
    """A job as OpenAI's ``Video`` object (plus ``num_frames``, ``fps``, ``seed``, ``attempts``); a stored request
    this code cannot read gives ``failed`` with the reason and null request fields (the list stays readable)."""
    status, error = job.status, job.error
    try:
        request = VideoRequest.from_dict(job.request)
    except (TypeError, ValueError) as exc:
        request, status, error = None, JobStatus.FAILED, f"the stored job cannot be read ({type(exc).__name__}); " \
                                                          "delete it"
    error = {"code": "render_failed", "message": redact_paths(error or "")} if status is JobStatus.FAILED else None
    fields = {name: getattr(request, name, None) for name in ("size", "seconds", "prompt", "num_frames", "fps",
                                                              "seed")}
    return {"id": job.id, "object": "video", "created_at": job.created_at, "status": status.value,
            "progress": job.progress, "model": model_name, "size": fields["size"], "seconds": fields["seconds"],
            "prompt": fields["prompt"], "completed_at": job.completed_at, "expires_at": None, "error": error,
            "remixed_from_video_id": None, "num_frames": fields["num_frames"], "fps": fields["fps"],
            "seed": fields["seed"], "attempts": job.attempt}


def add_video_routes(app, service, api_key: str | None, max_body_bytes: int,
                     max_queued: int | None = None) -> None:
    """Add the routes to ``app`` (a FastAPI app whose handlers turn :class:`APIError` into OpenAI's JSON). Every
    store call runs on the service's store threads (:meth:`~.service.VideoService.call`), never on the event
    loop: a store locked by another process holds up those calls only.

    Args:
        service: the :class:`~.service.VideoService`. api_key: Bearer token required on every route (None: open).
        max_body_bytes: limit of JSON bodies; multipart bodies have ``service.config.max_upload_bytes``.
        max_queued: ``--max-queued-videos`` (None: unbounded): a submit past it gets a 429 with ``Retry-After``.
    """
    from fastapi import Request
    from fastapi.responses import FileResponse, JSONResponse
    from starlette.exceptions import HTTPException

    name = service.model_name
    headers = {"openai-poll-after-ms": str(POLL_AFTER_MS)}

    async def submit(request: Request) -> Job:
        check_api_key(request, api_key)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        image = None
        if media == "multipart/form-data":
            # form() reads the body from request._body
            refuse_query(request)
            request._body = await read_body(request, service.config.max_upload_bytes, "--max-upload-mb")
            try:
                form = await request.form(max_files=1, max_fields=len(FIELDS))
            except HTTPException as exc:  # Starlette's own 400 for a form past its bounds: name the field
                files = "files" in str(exc.detail)
                raise bad_request(f"the form was refused: {exc.detail} (one input_reference file, and fields among "
                                  f"{', '.join(FIELDS)})", "input_reference" if files else None) from None
            body = {key: value for key, value in form.items() if key != "input_reference"}
            check_form_text(body, request._body)
            upload = form.get("input_reference")
            if upload is not None and not isinstance(upload, str):
                image = await upload.read()
            elif upload:
                raise bad_request("input_reference must be an uploaded image file", "input_reference")
        else:
            body = await read_json(request, max_body_bytes)
            if body.get("input_reference") is not None:
                raise bad_request("send input_reference as a file in a multipart/form-data request",
                                  "input_reference")
            body.pop("input_reference", None)
        return await service.call(service.submit, body, image, max_queued)

    async def find(video_id: str) -> Job:
        job = await service.call(service.store.get, video_id)
        if job is None:
            raise APIError(404, f"no video {video_id!r}", param="video_id", code="video_not_found")
        return job

    @app.post("/v1/videos")
    async def create(request: Request):
        job = await submit(request)
        return JSONResponse(video_object(job, name), headers=headers)

    @app.post("/v1/videos/sync")
    async def create_sync(request: Request):
        job = await submit(request)
        try:
            while not job.status.finished:
                if await request.is_disconnected():
                    await service.call(service.store.cancel, job.id)
                    raise APIError(499, "the client went away; the job was cancelled", code="client_closed")
                await asyncio.sleep(SYNC_POLL_S)
                job = await find(job.id)
        except asyncio.CancelledError:
            with contextlib.suppress(RuntimeError):  # RuntimeError: the server is shutting down (the threads too)
                service.executor.submit(service.store.cancel, job.id)  # not awaited: this task is being cancelled
            raise
        if job.status is not JobStatus.COMPLETED:
            raise APIError(500 if job.status is JobStatus.FAILED else 409,
                           f"video {job.id} {job.status.value}" + (f": {redact_paths(job.error)}" if job.error else ""),
                           code=f"video_{job.status.value}")
        return FileResponse(service.clip_path(job), media_type="video/mp4", headers={"x-video-id": job.id})

    @app.get("/v1/videos")
    async def list_videos(request: Request, limit: int = 20, after: str | None = None, order: str = "desc"):
        check_api_key(request, api_key)
        refuse_query(request, ("limit", "after", "order"))
        if not 1 <= limit <= MAX_LIST:
            raise bad_request(f"limit must be in 1..{MAX_LIST}; got {limit}", "limit")
        if order != "desc":
            raise bad_request("only order=desc (newest first) is supported", "order")
        try:
            jobs = await service.call(service.store.list, limit + 1, after)
        except KeyError:
            raise APIError(404, f"no video {after!r} (the 'after' cursor)", param="after",
                           code="video_not_found") from None
        data = [video_object(j, name) for j in jobs[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit}

    @app.get("/v1/videos/{video_id}")
    async def retrieve(request: Request, video_id: str):
        check_api_key(request, api_key)
        return JSONResponse(video_object(await find(video_id), name), headers=headers)

    @app.get("/v1/videos/{video_id}/content")
    async def content(request: Request, video_id: str, variant: str = "video"):
        check_api_key(request, api_key)
        refuse_query(request, ("variant",))
        if variant != "video":
            raise bad_request(f"variant {variant!r} is not available; this server keeps the video only", "variant")
        job = await find(video_id)
        path = service.clip_path(job)
        if job.status is not JobStatus.COMPLETED or not path.is_file():
            raise APIError(404, f"video {video_id} is {job.status.value}: its content exists once it is completed",
                           param="video_id", code="video_not_ready")
        return FileResponse(path, media_type="video/mp4")

    @app.delete("/v1/videos/{video_id}")
    async def delete(request: Request, video_id: str):
        check_api_key(request, api_key)
        job = await find(video_id)
        if job.status.finished and await service.call(service.store.delete, video_id):
            await service.call(service.remove_files, job)
            return {"id": video_id, "object": "video.deleted", "deleted": True, "status": job.status.value}
        job = await service.call(service.store.cancel, video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": False, "status": job.status.value,
                "cancel_requested": job.cancel_requested}
