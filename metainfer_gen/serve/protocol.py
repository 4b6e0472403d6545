"""Parse and check OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) before any work.

Every field is checked by hand, so each refusal is a 400 naming the field (``param``) and the accepted range,
where a schema library would answer 422 with its own wording. Accepted fields follow OpenAI's API; the extras
``top_k``, ``ignore_eos`` and ``stop_token_ids`` follow vLLM's. Fields OpenAI defines that this server cannot
honour (``logprobs``, ``echo``, penalties, tools, ...) are refused when set to anything but their default,
rather than silently ignored; unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from metainfer_gen.llm.detokenizer import check_stop_strings
from metainfer_gen.serve.errors import bad_request

# field -> values that mean "not used" (anything else is refused: the server does not implement it)
_UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []), "repetition_penalty": (None, 1),
    "response_format": (None, {"type": "text"}),
}
_ROLES = ("system", "developer", "user", "assistant")


@dataclass(slots=True)
class GenerationRequest:
    """A checked request. Exactly one of ``prompt`` (completions: text or token ids) and ``messages`` (chat)."""

    model: str | None
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def parse_json_object(raw: bytes, content_type: str | None) -> dict:
    """The body as a JSON object.

    Raises:
        APIError: 400 for a missing or non-JSON content type, an empty body, malformed JSON, or JSON that is
            not an object (``[]``, ``null``, ``123``, ``"s"``).
    """
    media = (content_type or "").split(";")[0].strip().lower()
    if not media:
        raise bad_request("missing Content-Type header: send the body as JSON with "
                          "'Content-Type: application/json'", code="invalid_content_type")
    if media != "application/json" and not media.endswith("+json"):
        raise bad_request(f"Content-Type {media!r} is not JSON: send 'Content-Type: application/json'",
                          code="invalid_content_type")
    if not raw.strip():
        raise bad_request("empty request body: send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object; got {_json_kind(body)}", code="invalid_json")
    return body


def parse_completion_request(body: dict) -> GenerationRequest:
    """``/v1/completions``: ``prompt`` is a non-empty string, a list of token ids, or a list holding one of those.

    Raises:
        APIError: 400 naming the field.
    """
    if "prompt" not in body:
        raise bad_request("missing required field 'prompt'", "prompt", "missing_field")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad_request("prompt is empty: give some text", "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = [int(t) for t in prompt]
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"prompt holds {len(prompt)} prompts; this server takes one prompt per request", "prompt")
    else:
        raise bad_request("prompt must be a non-empty string or a non-empty list of token ids", "prompt")
    request = _common(body, max_tokens_default=16)
    request.prompt = prompt
    return request


def parse_chat_request(body: dict) -> GenerationRequest:
    """``/v1/chat/completions``: ``messages`` is a non-empty list of ``{"role", "content"}`` with text content
    (a string or a list of ``{"type": "text", "text": ...}`` parts, joined).

    Raises:
        APIError: 400 naming the field.
    """
    if "messages" not in body:
        raise bad_request("missing required field 'messages'", "messages", "missing_field")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}", f"{where}.role")
        checked.append({"role": role, "content": _message_text(message.get("content"), f"{where}.content")})
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    request = _common(body, max_tokens_default=None, max_tokens=max_tokens)
    request.messages = checked
    return request


def _message_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def _common(body: dict, *, max_tokens_default: int | None, max_tokens=...) -> GenerationRequest:
    for name, unused in _UNSUPPORTED.items():
        if body.get(name) not in unused:
            raise bad_request(f"{name} is not supported by this server; leave it out", name, "unsupported_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string; got {_json_kind(model)}", "model")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request(f"n must be 1 (this server returns one choice per request); got {n!r}", "n")
    max_tokens = body.get("max_tokens") if max_tokens is ... else max_tokens
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = max_tokens_default
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise bad_request(f"{name} must be an integer >= 1; got {max_tokens!r}", name)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad_request("stream_options must be an object, and only with stream: true", "stream_options")
    include_usage = bool(options) and _bool(options, "include_usage", "stream_options.include_usage")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise bad_request(f"temperature must be >= 0 (0 = greedy); got {temperature!r}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1]; got {top_p!r}", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise bad_request(f"top_k must be an integer >= 1, or 0 / -1 for all tokens; got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -2**63 <= seed < 2**64):
        raise bad_request(f"seed must be an integer in [-2**63, 2**64) (a 64-bit generator seed); got {seed!r}",
                          "seed")
    try:
        stop = check_stop_strings(body.get("stop"))
    except ValueError as exc:
        raise bad_request(str(exc), "stop") from None
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
    return GenerationRequest(model=model, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                             temperature=float(temperature), top_p=float(top_p), top_k=int(top_k or 0), seed=seed,
                             stop=stop, stop_token_ids=tuple(stop_ids), ignore_eos=_bool(body, "ignore_eos"))


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number; got {value!r}", name)
    return value


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{param or name} must be true or false; got {value!r}", param or name)
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
