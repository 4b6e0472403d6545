"""The fields an OpenAI request body may carry, and the checks of the scalar ones, each a 400 naming the field.

Three kinds of field: those this server implements (OpenAI's, and vLLM's extras ``top_k``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``); those OpenAI defines that it does not implement,
refused unless set to the value that means "not used" (rather than silently ignored); and OpenAI's bookkeeping
fields that change no output (``user``, ``metadata``...), accepted and ignored. Any other field is refused by
name: a misspelt ``max_token`` must not run with a default in its place.
"""

from __future__ import annotations

import math

from metainfer_gen.serve.errors import bad_request

# Implemented by both endpoints.
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "stop_token_ids", "ignore_eos", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "min_tokens", "logprobs"}
IMPLEMENTED = {"completions": _COMMON | {"prompt"},
               "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}}
# field -> values that mean "not used" (anything else is refused: the server does not implement it)
UNSUPPORTED = {
    "completions": {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}),
                    "min_p": (None, 0), "include_stop_str_in_output": (None, False),
                    "skip_special_tokens": (None, True)},
    "chat": {"logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
             "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "audio": (None,),
             "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
             "web_search_options": (None,), "min_p": (None, 0), "include_stop_str_in_output": (None, False),
             "skip_special_tokens": (None, True)},
}
# OpenAI's fields that change no output here: accepted (of their type, or null), not used.
_BOOKKEEPING = {"user": str, "metadata": dict, "store": bool, "service_tier": str, "parallel_tool_calls": bool,
                "prompt_cache_key": str, "safety_identifier": str}
IGNORED = {"completions": {"user": str}, "chat": _BOOKKEEPING}


def check_fields(body: dict, endpoint: str) -> None:
    """Refuse unknown fields and non-default values of unimplemented ones (``endpoint``: "completions" / "chat").

    Raises:
        APIError: 400 naming the field (code ``unknown_parameter`` or ``unsupported_parameter``).
    """
    unsupported = UNSUPPORTED[endpoint]
    for name, value in body.items():
        if name in IMPLEMENTED[endpoint]:
            continue
        if name in IGNORED[endpoint]:
            kind = IGNORED[endpoint][name]
            if value is not None and not isinstance(value, kind):
                raise bad_request(f"{name} must be {json_kind(kind())} or null; got {json_kind(value)}", name)
            continue
        if name in unsupported:
            if value not in unsupported[name]:
                raise bad_request(f"{name} is not supported by this server; leave it out", name,
                                  "unsupported_parameter")
            continue
        raise bad_request(f"unknown field {name!r}: this endpoint takes "
                          f"{', '.join(sorted(IMPLEMENTED[endpoint]))}", name, "unknown_parameter")


def number(body: dict, name: str, default: float, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> float:
    """``body[name]`` as a finite number in [low, high] (``(low, high]`` with ``low_open``), or ``default``."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number; got {value!r}", name)
    below = low is not None and (value <= low if low_open else value < low)
    if below or (high is not None and value > high):
        interval = f"in {'(' if low_open else '['}{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise bad_request(f"{name} must be {interval}; got {value!r}", name)
    return value


def integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    """``body[name]`` as an integer in [low, high], or ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise bad_request(f"{name} must be an integer {bounds}; got {value!r}", name)
    return int(value)


def boolean(body: dict, name: str, param: str | None = None) -> bool:
    """``body[name]`` as a bool (absent or null: False)."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{param or name} must be true or false; got {value!r}", param or name)
    return value


def is_int(value) -> bool:
    """True for a JSON integer: an int, or a float with no fraction (JSON Schema's ``1.0`` is an integer);
    ``True`` / ``False`` are not. Read the value with ``int()``."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def json_kind(value) -> str:
    """How JSON names the type of ``value``, for messages ("an object", "an array", ...)."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
