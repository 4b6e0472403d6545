"""Parse and check OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) before any work.

Every field is checked by hand, so each refusal is a 400 naming the field (``param``) and the accepted range,
where a schema library would answer 422 with its own wording. Which fields exist, and which are refused or
ignored, is :mod:`metainfer_gen.serve.request_fields`; unknown fields are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from metainfer_gen.llm.detokenizer import check_stop_strings
from metainfer_gen.llm.sequence import MAX_LOGPROBS, MAX_REPETITION_PENALTY
from metainfer_gen.serve.errors import bad_request
from metainfer_gen.serve.request_fields import boolean, check_fields, integer, is_int, json_kind, number

_ROLES = ("system", "developer", "user", "assistant")
MAX_N = 16  # samples per prompt
MAX_CHOICES = 64  # prompts x n in one request


@dataclass(slots=True)
class GenerationRequest:
    """A checked request. Exactly one of ``prompts`` (completions: texts or token-id lists) and ``messages``
    (chat). ``logprobs``: None, or how many top tokens to return per token (0: only the sampled one's)."""

    model: str | None
    prompts: list[str | list[int]] | None = None
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
    n: int = 1
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    @property
    def num_choices(self) -> int:
        return self.n * (len(self.prompts) if self.prompts is not None else 1)


def parse_completion_request(body: dict) -> GenerationRequest:
    """``/v1/completions``: ``prompt`` is a non-empty string, a list of token ids, or a list of those (a batch:
    choice ``i * n + j`` is sample j of prompt i).

    Raises:
        APIError: 400 naming the field.
    """
    check_fields(body, "completions")
    if "prompt" not in body:
        raise bad_request("missing required field 'prompt'", "prompt", "missing_field")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise bad_request("prompt must be a non-empty string, a non-empty list of token ids, or a non-empty list "
                          "of those", "prompt")
    checked = []
    for i, one in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 and one is prompt else f"prompt[{i}]"
        if isinstance(one, str):
            if not one.strip():
                raise bad_request(f"{where} is empty: give some text", where)
            checked.append(one)
        elif one and all(is_int(t) for t in one):
            checked.append([int(t) for t in one])
        else:
            raise bad_request(f"{where} must be a non-empty string or a non-empty list of token ids", where)
    request = _common(body, max_tokens_default=16)
    request.prompts = checked
    request.logprobs = integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    _check_choices(request)
    return request


def parse_chat_request(body: dict) -> GenerationRequest:
    """``/v1/chat/completions``: ``messages`` is a non-empty list of ``{"role", "content"}`` with text content
    (a string or a list of ``{"type": "text", "text": ...}`` parts, joined).

    Raises:
        APIError: 400 naming the field.
    """
    check_fields(body, "chat")
    integer(body, "max_tokens", None, 1)  # beside max_completion_tokens (the one that counts) it must still be valid
    request = _common(body, max_tokens_default=None, max_tokens=body.get("max_completion_tokens",
                                                                          body.get("max_tokens")))
    request.messages = parse_messages(body)
    top = integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not boolean(body, "logprobs"):
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    request.logprobs = (top or 0) if boolean(body, "logprobs") else None
    _check_choices(request)
    return request


def parse_messages(body: dict) -> list[dict]:
    """``body["messages"]`` checked: ``[{"role", "content"}]`` with text content.

    Raises:
        APIError: 400 naming the message and field.
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
    return checked


def _check_choices(request: GenerationRequest) -> None:
    if request.num_choices > MAX_CHOICES:
        raise bad_request(f"this request asks for {request.num_choices} choices (prompts x n); at most "
                          f"{MAX_CHOICES} per request", "n")


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
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string; got {json_kind(model)}", "model")
    max_tokens = body.get("max_tokens") if max_tokens is ... else max_tokens
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = max_tokens_default
    elif not is_int(max_tokens) or max_tokens < 1:
        raise bad_request(f"{name} must be an integer >= 1; got {max_tokens!r}", name)
    else:
        max_tokens = int(max_tokens)
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad_request("stream_options must be an object, and only with stream: true", "stream_options")
    include_usage = bool(options) and boolean(options, "include_usage", "stream_options.include_usage")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not -2**63 <= seed < 2**64):
        raise bad_request(f"seed must be an integer in [-2**63, 2**64) (a 64-bit generator seed); got {seed!r}",
                          "seed")
    seed = None if seed is None else int(seed)
    try:
        stop = check_stop_strings(body.get("stop"))
    except ValueError as exc:
        raise bad_request(str(exc), "stop") from None
    stop_ids = [] if body.get("stop_token_ids") is None else body["stop_token_ids"]
    if not isinstance(stop_ids, list) or not all(is_int(t) and t >= 0 for t in stop_ids):
        raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
    min_tokens = integer(body, "min_tokens", 0, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed {name} ({max_tokens})", "min_tokens")
    return GenerationRequest(
        model=model, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
        temperature=float(number(body, "temperature", 1.0, 0.0)), top_p=float(number(body, "top_p", 1.0, 0.0, 1.0,
                                                                                       low_open=True)),
        top_k=integer(body, "top_k", 0, -1), seed=seed, stop=stop, stop_token_ids=tuple(int(t) for t in stop_ids),
        ignore_eos=boolean(body, "ignore_eos"), n=integer(body, "n", 1, 1, MAX_N), min_tokens=min_tokens,
        presence_penalty=float(number(body, "presence_penalty", 0.0, -2.0, 2.0)),
        frequency_penalty=float(number(body, "frequency_penalty", 0.0, -2.0, 2.0)),
        repetition_penalty=float(number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY,
                                        low_open=True)))
