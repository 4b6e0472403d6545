"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal of the server is an :class:`APIError` raised before any engine work; the app turns it (and
Starlette's own 404/405) into that body, so clients (the ``openai`` SDK's ``BadRequestError`` etc.) read the
message and the field that was wrong.
"""

from __future__ import annotations

import re
from http import HTTPStatus

_ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/])/(?:[^\s'\":,()/]+/)+([^\s'\":,()/]*)")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "requests",
          500: "internal_server_error", 503: "service_unavailable"}
RETRY_AFTER_S = 1  # what a 429 / 503 of a full queue or a busy store asks a client to wait, seconds


class APIError(Exception):
    """A request the server refuses.

    Args:
        status: HTTP status (400 bad input, 401 bad API key, 404 no such route, 413 body too large, ...).
        message: what was wrong and how to fix it.
        param: the request field at fault, or None.
        code: a short machine-readable code ("invalid_value", "model_not_found", "context_length_exceeded", ...).
        headers: extra response headers (``Retry-After`` of a 429 or 503).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def retry_later(status: int, message: str, code: str, retry_after_s: int = RETRY_AFTER_S) -> APIError:
    """A refusal that is no fault of the request: 429 (a full queue, OpenAI's type ``requests``) or 503 (a busy
    store), with ``Retry-After: retry_after_s`` (seconds), which the ``openai`` SDK's retries honour."""
    return APIError(status, f"{message}; retry in {retry_after_s} s", code=code,
                    headers={"Retry-After": str(retry_after_s)})


def http_error(status: int, detail: str | None = None) -> APIError:
    """An APIError for a plain HTTP status (Starlette's 404 / 405)."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    return APIError(status, detail if detail and detail != phrase else phrase, code=phrase.lower().replace(" ", "_"))


def redact_paths(text: str) -> str:
    """``text`` with every absolute path cut to its last component (``/srv/data/clips/x.mp4`` -> ``.../x.mp4``),
    for messages that come from exceptions (a job's recorded error): a body must not show the server's layout."""
    return _ABSOLUTE_PATH.sub(lambda m: f".../{m.group(1)}", text)
