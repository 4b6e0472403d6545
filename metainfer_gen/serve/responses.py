"""OpenAI response bodies and server-sent-event chunks for completions and chat completions.

Shapes follow OpenAI's API reference (``text_completion``, ``chat.completion``, ``chat.completion.chunk``): a
stream is ``data: {chunk}\\n\\n`` lines ending with ``data: [DONE]``; with ``stream_options.include_usage`` every
chunk carries ``"usage": null`` and one last chunk with empty ``choices`` carries the usage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One server-sent event carrying ``payload`` as JSON (UTF-8, not ASCII-escaped)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens`` (prompt tokens read from the prefix cache,
    over every choice) when given."""
    body = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return body


@dataclass(slots=True)
class ResponseFormat:
    """Builds the bodies of one request: ``chat`` picks the chat shapes, else the completions ones.

    Args:
        request_id: "cmpl-..." or "chatcmpl-...".
        model: the served model name.
        created: Unix seconds.
        chat: chat completion shapes.
        include_usage: streamed chunks carry ``usage`` (null until the last).
    """

    request_id: str
    model: str
    created: int
    chat: bool
    include_usage: bool = False

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
        """One choice of the whole (non-streamed) answer."""
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def response(self, choices: list[dict], num_prompt_tokens: int, num_completion_tokens: int,
                 num_cached_tokens: int | None = None) -> dict:
        """The whole (non-streamed) answer, from :meth:`choice` dicts."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        body["choices"] = choices
        body["usage"] = usage(num_prompt_tokens, num_completion_tokens, num_cached_tokens)
        return body

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False, index: int = 0,
              logprobs: dict | None = None) -> bytes:
        """One streamed chunk of choice ``index``: new ``text`` (with its tokens' ``logprobs``), or the closing
        ``finish_reason``; ``role`` opens a chat choice."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, num_prompt_tokens: int, num_completion_tokens: int,
                    num_cached_tokens: int | None = None) -> bytes:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(num_prompt_tokens, num_completion_tokens, num_cached_tokens)
        return sse(body)
