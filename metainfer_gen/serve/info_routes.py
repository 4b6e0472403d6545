"""The routes that describe the server rather than run a model: ``GET /v1/models`` (every served model, LLM and
video, with its kind), ``GET /version`` (vLLM's shape), and ``HEAD`` beside every ``GET`` (added last, once every
front end has added its routes). ``/openapi.json`` and ``/docs`` are FastAPI's own (:func:`~.app.new_app`),
with the request schemas of :mod:`metainfer_gen.serve.openapi_docs`."""

# No ``from __future__ import annotations``: FastAPI reads the ``Request`` annotation at definition time.
import time

from metainfer_gen.serve.http_io import check_api_key


def served_model(name: str, kind: str, **extra) -> dict:
    """One ``/v1/models`` entry (OpenAI's ``model`` object, vLLM's ``root`` and ``max_model_len``, our ``kind``:
    "llm" or "video")."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "metainfer-gen", "root": name,
            "kind": kind, **extra}


def add_info_routes(app, api_key: str | None) -> None:
    """Add ``/v1/models`` and ``/version`` to ``app`` (its ``app.state.models`` lists the entries), then a
    ``HEAD`` route beside every ``GET`` one (same handler and responses; uvicorn sends no body)."""
    from fastapi import Request
    from fastapi.routing import APIRoute

    from metainfer_gen import __version__
    from metainfer_gen.serve.openapi_docs import MODEL_LIST, VERSION

    @app.get("/v1/models", responses={200: MODEL_LIST})
    async def models(request: Request):
        check_api_key(request, api_key)
        return {"object": "list", "data": list(app.state.models)}

    @app.get("/version", responses={200: VERSION})
    async def version():
        return {"version": __version__}

    for route in [r for r in app.routes if isinstance(r, APIRoute) and "GET" in r.methods]:
        app.add_api_route(route.path, route.endpoint, methods=["HEAD"], name=f"{route.name}_head",
                          response_class=route.response_class, responses=route.responses,
                          include_in_schema=route.include_in_schema, openapi_extra=route.openapi_extra)
