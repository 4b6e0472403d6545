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


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


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

    def response(self, text: str, finish_reason: str, num_prompt_tokens: int, num_completion_tokens: int) -> dict:
        """The whole (non-streamed) answer."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage(num_prompt_tokens, num_completion_tokens)
        return body

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> bytes:
        """One streamed chunk: new ``text``, or the closing ``finish_reason``; ``role`` opens a chat stream."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, num_prompt_tokens: int, num_completion_tokens: int) -> bytes:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(num_prompt_tokens, num_completion_tokens)
        return sse(body)
