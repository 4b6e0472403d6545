"""Run one checked OpenAI request on the async engine: sampling settings, context checks, then a whole answer or an
SSE stream, aborting the request as soon as its client goes away.
"""

from __future__ import annotations

import time
import uuid

from metainfer_gen.llm.engine import RequestRejected
from metainfer_gen.llm.sequence import SamplingParams
from metainfer_gen.serve.errors import APIError, bad_request
from metainfer_gen.serve.http_io import on_disconnect
from metainfer_gen.serve.protocol import GenerationRequest
from metainfer_gen.serve.responses import DONE, ResponseFormat, sse


def sampling_params(req: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """Engine settings for ``req``; no ``max_tokens`` means the rest of the context.

    Raises:
        APIError: 400 (code ``context_length_exceeded``) when the prompt plus ``max_tokens`` exceeds
            ``max_model_len``, with the three numbers.
    """
    field = "messages" if req.messages is not None else "prompt"
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the {field} has "
                            f"{num_prompt_tokens} tokens, leaving none to generate; shorten the {field}",
                       param=field, code="context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; you asked for "
                            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the {field}, {max_tokens} in "
                            f"the completion); shorten the {field} or lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                              top_p=req.top_p, seed=req.seed, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos)
    except ValueError as exc:  # the protocol checks should have caught it; still a 400, never a 500
        raise bad_request(str(exc)) from None


async def generate(front, request, req: GenerationRequest, prompt_ids: list[int], model_name: str,
                   max_model_len: int):
    """Queue ``req`` and answer: a JSON dict (whole answer) or an async iterator of SSE bytes (``stream``).

    Raises:
        APIError: 400 for a prompt too long for the context or the KV pool, or token ids outside the vocabulary.
    """
    params = sampling_params(req, len(prompt_ids), max_model_len)
    chat = req.messages is not None
    fmt = ResponseFormat(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model_name, int(time.time()),
                         chat, req.include_usage)
    field = "messages" if chat else "prompt"
    try:
        stream = await front.add(prompt_ids, params, req.stop, request_id=fmt.request_id)
    except RequestRejected as exc:
        raise APIError(400, str(exc), param=field, code="context_length_exceeded") from None
    except ValueError as exc:
        raise bad_request(str(exc), field) from None
    # Watch from now on, not from the stream's first chunk: a client gone before Starlette starts the stream
    # (which then never runs its ``finally``) is aborted all the same.
    watcher = on_disconnect(request, lambda: front.abort(stream.request_id))
    if req.stream:
        return _stream(front, stream, fmt, watcher)
    return await _collect(front, stream, fmt, watcher)


async def _collect(front, stream, fmt: ResponseFormat, watcher) -> dict:
    parts, last = [], None
    try:
        async for event in stream:
            parts.append(event.text)
            last = event
    finally:
        watcher.cancel()
        if not stream.done:  # this handler was cancelled: nobody will read the answer
            front.abort(stream.request_id)
    if last.finish_reason == "error":
        raise APIError(500, f"generation failed: {last.error}", code="engine_error")
    return fmt.response("".join(parts), _openai_reason(last.finish_reason), last.num_prompt_tokens,
                        last.num_output_tokens)


async def _stream(front, stream, fmt: ResponseFormat, watcher):
    try:
        if fmt.chat:
            yield fmt.chunk(role=True)
        async for event in stream:
            if event.text:
                yield fmt.chunk(event.text)
            if not event.finished:
                continue
            if event.finish_reason == "error":
                yield sse(APIError(500, f"generation failed: {event.error}", code="engine_error").body())
            else:
                yield fmt.chunk(None, _openai_reason(event.finish_reason))
            if fmt.include_usage:
                yield fmt.usage_chunk(event.num_prompt_tokens, event.num_output_tokens)
            yield DONE
    finally:  # also when Starlette cancels the stream because the client disconnected
        watcher.cancel()
        if not stream.done:
            front.abort(stream.request_id)


def _openai_reason(reason: str) -> str:
    """OpenAI knows "stop" and "length"; an aborted request (its client is gone) reads as "stop"."""
    return "length" if reason == "length" else "stop"
