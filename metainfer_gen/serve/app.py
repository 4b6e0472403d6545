"""The FastAPI app: OpenAI's LLM routes over an :class:`~metainfer_gen.serve.async_engine.AsyncLLMEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` for SSE), ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes), ``GET /health``, ``GET /metrics`` (Prometheus), and
(:mod:`metainfer_gen.serve.info_routes`) ``GET /version``, ``GET /openapi.json``, ``GET /docs``; ``HEAD`` wherever
``GET``. With an API key, every route but ``/health``, ``/metrics``, ``/version`` and the schema needs
``Authorization: Bearer <key>`` (as vLLM, whose scrapers and probes send none). Every error is OpenAI's error JSON
(:mod:`metainfer_gen.serve.errors`).
"""

# No ``from __future__ import annotations``: FastAPI reads the route signatures' ``Request`` annotations at
# definition time, and ``Request`` is imported inside ``build_app`` (fastapi is an optional extra).
import asyncio
import logging
import uuid
from dataclasses import dataclass

from metainfer_gen.serve.admission import DEFAULT_HEALTH_STEP_TIMEOUT_S, engine_problem
from metainfer_gen.serve.chat import chat_token_ids
from metainfer_gen.serve.errors import APIError, bad_request, error_body, http_error
from metainfer_gen.serve.generation import generate
from metainfer_gen.serve.http_io import DEFAULT_MAX_BODY_BYTES, check_api_key, read_json
from metainfer_gen.serve.info_routes import served_model
from metainfer_gen.serve.protocol import parse_chat_request, parse_completion_request, parse_messages
from metainfer_gen.serve.request_fields import is_int

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AppSettings:
    """Args:
        model_name: the name clients pass as ``model`` (requests naming another model get a 400).
        api_key: required Bearer token, or None for an open server.
        max_body_bytes: request bodies larger than this get a 413 (default 1 MiB).
        max_queued_requests: LLM requests that may wait behind the running batch; more get a 429 with
            ``Retry-After`` (None: unbounded).
        max_queued_videos: video jobs that may wait in the queue; more get a 429 (None: unbounded).
        health_step_timeout_s: ``/health`` answers 503 once the engine has not stepped for this long while
            requests wait, seconds.
    Raises:
        ValueError: an empty name or key, or a non-positive limit.
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued_requests: int | None = None
    max_queued_videos: int | None = None
    health_step_timeout_s: float = DEFAULT_HEALTH_STEP_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must be a non-empty string")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be None or a non-empty string")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1; got {self.max_body_bytes}")
        if any(n is not None and n < 0 for n in (self.max_queued_requests, self.max_queued_videos)):
            raise ValueError(f"max_queued_requests and max_queued_videos must be None or >= 0; got "
                             f"{self.max_queued_requests}, {self.max_queued_videos}")
        if not self.health_step_timeout_s > 0:
            raise ValueError(f"health_step_timeout_s must be > 0; got {self.health_step_timeout_s}")


def new_app():
    """An empty FastAPI app whose every error (ours, Starlette's 404/405, any exception) is OpenAI's error JSON."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from fastapi.routing import APIRoute
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import Response

    from metainfer_gen import __version__

    app = FastAPI(title="metainfer-gen", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.models = []  # the /v1/models entries: each front end adds its own

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):  # a typed query parameter: our 400, not a 422
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        err = bad_request(f"{where or 'the request'}: {first.get('msg', 'invalid value')}", where)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        err = http_error(exc.status_code, exc.detail if isinstance(exc.detail, str) else None)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of the path (Starlette names only the first route's)
            headers["Allow"] = ", ".join(sorted(allowed_methods(app, request.scope)))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):  # what escaped the routes' own guard (middleware, a stream)
        return internal_error(request, exc)

    class GuardedRoute(APIRoute):
        """A route whose unexpected exception becomes the 500 here, not re-raised to the server (Starlette's
        error middleware re-raises, and uvicorn then resets the client's kept-alive connection)."""

        def get_route_handler(self):
            handler = super().get_route_handler()

            async def guarded(request):
                try:
                    return await handler(request)
                except (APIError, HTTPException, RequestValidationError):
                    raise
                except ClientDisconnect:  # gone before its body arrived: nobody to answer, one log line
                    log.info("%s %s: the client disconnected before its body arrived", request.method,
                             request.url.path)
                    return Response(status_code=400)
                except Exception as exc:  # noqa: BLE001 - logged with its request id, answered without its text
                    return internal_error(request, exc)

            return guarded

    app.router.route_class = GuardedRoute
    return app


def internal_error(request, exc: Exception):
    """The 500 of an unexpected exception: logged with a new request id and its traceback; the body names the
    exception's type and the id, never ``str(exc)`` (it may carry paths), and so does the ``x-request-id`` header."""
    from fastapi.responses import JSONResponse

    request_id = f"req-{uuid.uuid4().hex[:16]}"
    log.error("%s %s failed (request id %s)", request.method, request.url.path, request_id, exc_info=exc)
    return JSONResponse(error_body(f"internal error ({type(exc).__name__}), request id {request_id}; the server's "
                                   f"log has the details under that id", "internal_server_error"),
                        status_code=500, headers={"x-request-id": request_id})


def allowed_methods(app, scope) -> set[str]:
    """The methods the routes of ``app`` accept on the path of ``scope``."""
    from starlette.routing import Match

    matching = [route for route in app.router.routes
                if getattr(route, "methods", None) and route.matches(scope)[0] is not Match.NONE]
    literal = [route for route in matching if getattr(route, "path", None) == scope["path"]]
    # a literal path (/v1/videos/sync) is its own resource, though a templated one (/v1/videos/{id}) matches it too
    return {method for route in literal or matching for method in route.methods}


def build_app(front, metrics, settings: AppSettings, extra_health=None):
    """The app serving ``front``'s engine.

    Args:
        front: an :class:`~metainfer_gen.serve.async_engine.AsyncLLMEngine` (the caller closes it).
        metrics: the :class:`~metainfer_gen.serve.metrics.ServerMetrics` ``front`` reports to.
        settings: name, key and limits.
        extra_health: a further check for ``/health``: returns None when healthy, else why not (a 503).
    """
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    engine = front.engine
    tokenizer = engine.tokenizer
    app = new_app()

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise APIError(400, f"the model {name!r} does not exist; this server serves {settings.model_name!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    async def body_of(request: Request) -> dict:
        check_api_key(request, settings.api_key)
        return await read_json(request, settings.max_body_bytes)

    async def answer(request: Request, req, prompts_ids: list[list[int]]):
        result = await generate(front, request, req, prompts_ids, settings.model_name, engine.max_model_len,
                                settings.max_queued_requests)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion_request(await body_of(request))
        check_model(req.model)
        ids = [await asyncio.to_thread(encode_text, p) if isinstance(p, str) else p for p in req.prompts]
        return await answer(request, req, ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_chat_request(await body_of(request))
        check_model(req.model)
        return await answer(request, req, [await asyncio.to_thread(chat_token_ids, tokenizer, req.messages)])

    app.state.models.append(served_model(settings.model_name, "llm", max_model_len=engine.max_model_len))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        check_model(body.get("model"))
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise bad_request("add_special_tokens must be true or false", "add_special_tokens")
        if body.get("prompt") is not None and not isinstance(body["prompt"], str):
            raise bad_request("prompt must be a string", "prompt")
        if "messages" in body:
            ids = await asyncio.to_thread(chat_token_ids, tokenizer, parse_messages(body))
        elif isinstance(body.get("prompt"), str):
            ids = await asyncio.to_thread(encode_text, body["prompt"], add_special)
        else:
            raise bad_request("give 'prompt' (a string) or 'messages'", "prompt", "missing_field")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request)
        check_model(body.get("model"))
        ids = body.get("tokens")
        vocab = engine.model.config.vocab_size
        if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise bad_request(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": tokenizer.decode([int(t) for t in ids])}

    @app.get("/health")
    async def health():
        problem = engine_problem(front, settings.health_step_timeout_s) or (extra_health and extra_health())
        if problem:
            return JSONResponse(error_body(problem, "service_unavailable"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():  # off the loop: the video collector reads the job store
        body, content_type = await asyncio.to_thread(metrics.render)
        return Response(body, media_type=content_type)

    def encode_text(text: str, add_special_tokens: bool = True) -> list[int]:
        # Called in a worker thread: a prompt near the body limit takes ~0.5 s to tokenize, which would stall
        # every open stream if done on the event loop (encoding reads the tokenizer, never changes it).
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    return app
