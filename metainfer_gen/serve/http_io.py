"""Request plumbing shared by the routes: bounded body reading, the API key, and watching for a client that left.

Nothing here knows about models; every refusal is an :class:`~metainfer_gen.serve.errors.APIError`.
"""

from __future__ import annotations

import asyncio
import secrets

from metainfer_gen.serve.errors import APIError, bad_request
from metainfer_gen.serve.json_body import parse_json_object

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a prompt of the longest context fits many times over


async def read_json(request, max_body_bytes: int) -> dict:
    """The request's JSON object, reading at most ``max_body_bytes`` bytes
    (:func:`~metainfer_gen.serve.json_body.parse_json_object`).

    Raises:
        APIError: 413 when ``Content-Length`` or the bytes actually sent exceed the limit (checked before and
            while reading, so a chunked upload cannot grow past it); 400 for a query string (see
            :func:`refuse_query`) or anything but a JSON object of valid text.
    """
    refuse_query(request)
    return parse_json_object(await read_body(request, max_body_bytes), request.headers.get("content-type"))


def refuse_query(request, accepted: tuple[str, ...] = ()) -> None:
    """Refuse query parameters other than ``accepted`` (a POST route takes its fields in the body, so a
    ``?stream=true`` would otherwise be silently ignored).

    Raises:
        APIError: 400 naming the first parameter not accepted.
    """
    for name in request.query_params:
        if name not in accepted:
            where = "in the JSON body" if not accepted else f"only {', '.join(accepted)} in the query string"
            raise bad_request(f"query parameter {name!r} is not accepted here: this route takes {where}",
                              name if name.isprintable() else None, "unknown_parameter")


async def read_body(request, max_body_bytes: int, limit_flag: str = "--max-body-bytes") -> bytes:
    """The request's body, reading at most ``max_body_bytes`` bytes.

    Raises:
        APIError: 413 when ``Content-Length`` or the bytes actually sent exceed the limit (checked before and
            while reading, so a chunked upload cannot grow past it).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(int(declared), max_body_bytes, limit_flag)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _too_large(size, max_body_bytes, limit_flag, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, limit_flag: str, at_least: bool = False) -> APIError:
    return APIError(413, f"request body of {'more than ' if at_least else ''}{size} bytes exceeds the server's "
                         f"limit of {limit} bytes ({limit_flag})", code="request_too_large")


def check_api_key(request, api_key: str | None) -> None:
    """Require ``Authorization: Bearer <api_key>`` when the server has a key (compared in constant time).

    Raises:
        APIError: 401 when the header is missing, not a Bearer token, or the wrong key.
    """
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


async def wait_for_disconnect(request) -> None:
    """Return once the client has closed the connection (the ASGI ``http.disconnect`` message).

    Call only after the body was read: the server then answers ``receive`` with nothing but the disconnect.
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def on_disconnect(request, callback) -> asyncio.Task:
    """A task that calls ``callback()`` when the client goes away; cancel it when the answer is complete."""

    async def watch() -> None:
        await wait_for_disconnect(request)
        callback()

    return asyncio.create_task(watch())
