"""What ``/openapi.json`` says about the routes: request bodies and responses, for schema-driven tools
(schemathesis, client generators) and ``/docs``.

The handlers check their bodies by hand (each refusal a 400 naming the field, :mod:`metainfer_gen.serve.protocol`),
so the bodies are described here, in JSON Schema, and merged into FastAPI's generated document by path and method;
every operation also lists the errors it can answer in OpenAI's error JSON. The bounds follow the checks
(:mod:`~metainfer_gen.serve.request_fields`); a test keeps the two in step by sending schema-valid bodies.
"""

from __future__ import annotations

import copy

from metainfer_gen.llm.detokenizer import MAX_STOP_CHARS, MAX_STOP_STRINGS
from metainfer_gen.llm.sequence import MAX_LOGPROBS, MAX_REPETITION_PENALTY
from metainfer_gen.serve.protocol import MAX_N

_NULLABLE_INT = {"type": ["integer", "null"]}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}
_ERRORS = {"400": "bad request (the field is in error.param)", "401": "missing or wrong API key",
           "404": "no such route or object", "405": "method not allowed", "413": "body over the limit",
           "500": "internal error", "503": "not ready or not healthy"}


# one server-sent event as schema-driven tools parse it: ``data`` is a JSON chunk or ``[DONE]``
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"},
                                                                      "event": {"type": "string"}}}


def json_response(schema: dict, description: str = "OK", stream: bool = False) -> dict:
    """A response with a JSON body (and an SSE stream with ``stream``)."""
    content = {"application/json": {"schema": schema}}
    if stream:
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    return {"description": description, "content": content}


MODEL_LIST = json_response({"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "kind"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "kind": {"enum": ["llm", "video"]}}}}}})
VERSION = json_response({"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}})


def _needs(field: str, kind: str, other: str) -> dict:
    """JSON Schema: a non-null ``field`` (of type ``kind``) needs ``other: true`` (OpenAI's and vLLM's rules)."""
    return {"if": {"required": [field], "properties": {field: {"type": kind}}},
            "then": {"required": [other], "properties": {other: {"const": True}}}}


def _sampling(vocab_size: int) -> dict:
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    penalty = {"type": "number", "minimum": -2, "maximum": 2}
    return {
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": ["boolean", "null"]}}},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": -1},
        "seed": {"type": ["integer", "null"], "minimum": -2**63, "maximum": 2**64 - 1},
        "stop": {"oneOf": [stop_string, {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
                           {"type": "null"}]},
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
        "ignore_eos": {"type": ["boolean", "null"]},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N},
        "presence_penalty": {**penalty, "type": ["number", "null"]},
        "frequency_penalty": {**penalty, "type": ["number", "null"]},
        "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0,
                               "maximum": MAX_REPETITION_PENALTY},
        "min_tokens": {"type": ["integer", "null"], "minimum": 0},
        "user": {"type": ["string", "null"]},
    }


def _choices(chat: bool) -> dict:
    body = ({"message": {"type": "object", "required": ["role", "content"]}} if chat else {"text": {"type": "string"}})
    return {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason", *body],
                                       "properties": {"index": {"type": "integer"},
                                                      "finish_reason": {"enum": ["stop", "length"]},
                                                      "logprobs": {"type": ["object", "null"]}, **body}}}


def _answer(chat: bool) -> dict:
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"]}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": "chat.completion" if chat else
                                                                "text_completion"},
                           "created": {"type": "integer"}, "model": {"type": "string"}, "choices": _choices(chat),
                           "usage": usage}}


def llm_operations(model_name: str, vocab_size: int) -> dict:
    """``{(path, method): operation fields}`` for the LLM routes of a server serving ``model_name``."""
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                           "maximum": vocab_size - 1}}
    text = {"type": "string", "minLength": 1, "pattern": r"\S"}
    model = {"type": ["string", "null"], "enum": [model_name, None]}
    completion = {"type": "object", "required": ["prompt"], "additionalProperties": False,
                  "allOf": [_needs("stream_options", "object", "stream")], "properties": {
        "model": model, "prompt": {"oneOf": [text, token_ids, {"type": "array", "minItems": 1, "maxItems": 64,
                                                               "items": {"oneOf": [text, token_ids]}}]},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS}, **_sampling(vocab_size)}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}}
    chat = {"type": "object", "required": ["messages"], "additionalProperties": False,
            "allOf": [_needs("stream_options", "object", "stream"), _needs("top_logprobs", "integer", "logprobs")],
            "properties": {
        "model": model, "messages": {"type": "array", "minItems": 1, "items": message},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
        **_sampling(vocab_size)}}
    tokenize = {"type": "object", "anyOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                                            {"required": ["messages"]}],
                "properties": {"model": model, "prompt": {"type": ["string", "null"]},
                               "add_special_tokens": {"type": "boolean"},
                               "messages": {"type": "array", "minItems": 1, "items": message}}}
    tokens = {"type": "object", "required": ["count", "max_model_len", "tokens"],
              "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                             "tokens": {"type": "array", "items": {"type": "integer"}}}}
    detokenize = {"type": "object", "required": ["tokens"],
                  "properties": {"model": model, "tokens": {**token_ids, "minItems": 0}}}
    return {
        ("/v1/completions", "post"): _operation(completion, json_response(_answer(False), stream=True)),
        ("/v1/chat/completions", "post"): _operation(chat, json_response(_answer(True), stream=True)),
        ("/tokenize", "post"): _operation(tokenize, json_response(tokens)),
        ("/detokenize", "post"): _operation(detokenize, json_response({"type": "object", "required": ["prompt"],
                                                               "properties": {"prompt": {"type": "string"}}})),
    }


def common_operations() -> dict:
    """The routes every server has: ``/health`` (503 when not healthy), ``/metrics`` (Prometheus text)."""
    return {("/health", "get"): _operation(None, json_response({"type": "object", "required": ["status"]})),
            ("/metrics", "get"): _operation(None, {"description": "Prometheus exposition",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}})}


def json_body(schema: dict) -> dict:
    """An operation's JSON ``requestBody``."""
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _operation(body: dict | None, ok: dict) -> dict:
    operation = {"responses": {"200": ok}}
    if body is not None:
        operation["requestBody"] = json_body(body)
    return operation


def install_schema(app, operations: dict) -> None:
    """Make ``app.openapi()`` FastAPI's document with ``operations`` merged in and every operation's errors
    listed (FastAPI's 422 replaced: validation errors are our 400s); ``HEAD`` operations answer headers only."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, methods in schema.get("paths", {}).items():
                for method, operation in methods.items():
                    _merge(operation, operations.get((path, "get" if method == "head" else method), {}),
                           head=method == "head")
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _merge(operation: dict, extra: dict, head: bool) -> None:
    extra = copy.deepcopy(extra)  # operations share the tables' dicts: never edit them in place
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    for code, description in _ERRORS.items():
        responses.setdefault(code, json_response(ERROR, description))
    responses.update(extra.get("responses", {}))
    for parameter in operation.get("parameters", []):  # the checks' bounds on typed query parameters
        if parameter["name"] in extra.get("parameters", {}):
            parameter["schema"] = extra["parameters"][parameter["name"]]
    if "requestBody" in extra:
        operation["requestBody"] = extra["requestBody"]
    if head:
        operation["responses"] = {code: {"description": response.get("description", "")}
                                  for code, response in responses.items()}
