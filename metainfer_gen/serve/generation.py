"""Run one checked OpenAI request on the async engine: sampling settings, context checks, then a whole answer or an
SSE stream, aborting the request as soon as its client goes away.

A request with several prompts, or ``n`` > 1, becomes one engine request per choice (choice ``i * n + j`` is sample
j of prompt i). The first sample of each prompt is queued first and its siblings once its prompt is computed, so
they read the prompt's full KV blocks from the prefix cache instead of computing them again.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from metainfer_gen.llm.engine import RequestRejected
from metainfer_gen.llm.sequence import SamplingParams
from metainfer_gen.serve.admission import check_llm_admission
from metainfer_gen.serve.errors import APIError, bad_request
from metainfer_gen.serve.http_io import on_disconnect
from metainfer_gen.serve.logprobs_format import LogprobsFormatter
from metainfer_gen.serve.protocol import GenerationRequest
from metainfer_gen.serve.responses import DONE, ResponseFormat, sse


def sampling_params(req: GenerationRequest, num_prompt_tokens: int, max_model_len: int,
                    sample_index: int = 0, capacity_tokens: int | None = None) -> SamplingParams:
    """Engine settings for ``req``; no ``max_tokens`` means what the context and the KV pool can hold
    (``capacity_tokens``, the pool's tokens; OpenAI's meaning: the rest of the context), never a refusal for a
    pool smaller than ``max_model_len``. Sample j of ``n`` draws with ``seed + j`` when a seed is given, so the
    samples differ and each reproduces.

    Raises:
        APIError: 400 (code ``context_length_exceeded``) when the prompt plus ``max_tokens`` exceeds
            ``max_model_len``, with the three numbers; 400 for ``min_tokens`` beyond the tokens left.
    """
    field_name = "messages" if req.messages is not None else "prompt"
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the {field_name} "
                            f"has {num_prompt_tokens} tokens, leaving none to generate; shorten the {field_name}",
                       param=field_name, code="context_length_exceeded")
    room = min(max_model_len, capacity_tokens or max_model_len) - num_prompt_tokens
    max_tokens = req.max_tokens if req.max_tokens is not None else max(1, room)  # 1: the pool's refusal says why
    if num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; you asked for "
                            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the {field_name}, "
                            f"{max_tokens} in the completion); shorten the {field_name} or lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) exceeds the {max_tokens} tokens this prompt leaves",
                          "min_tokens")
    seed = None if req.seed is None else (req.seed + sample_index) % 2**64
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                              top_p=req.top_p, seed=seed, stop_token_ids=req.stop_token_ids,
                              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              repetition_penalty=req.repetition_penalty, logprobs=req.logprobs)
    except ValueError as exc:  # the protocol checks should have caught it; still a 400, never a 500
        raise bad_request(str(exc)) from None


@dataclass(slots=True)
class _Choice:
    """What one choice's stream gave so far."""

    index: int
    parts: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    last: object = None


async def generate(front, request, req: GenerationRequest, prompts_ids: list[list[int]], model_name: str,
                   max_model_len: int, max_queued: int | None = None):
    """Queue ``req`` (one list of token ids per prompt) and answer: a JSON dict (whole answer) or an async
    iterator of SSE bytes (``stream``). ``max_queued``: ``--max-queued-requests`` (None: unbounded).

    Raises:
        APIError: 400 for a prompt too long for the context or the KV pool, or token ids outside the vocabulary;
            429 with ``Retry-After`` when the queue is full (nothing queued).
    """
    _check_token_ids(prompts_ids, front.engine.model.config.vocab_size, req)
    capacity = front.engine.kv_capacity_tokens
    params = [[sampling_params(req, len(ids), max_model_len, j, capacity) for j in range(req.n)]
              for ids in prompts_ids]
    chat = req.messages is not None
    fmt = ResponseFormat(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model_name, int(time.time()),
                         chat, req.include_usage)
    check_llm_admission(front, req.num_choices, max_queued)  # no await from here to the first add
    streams = await _add_all(front, req, prompts_ids, params, fmt.request_id)
    # Watch from now on, not from the stream's first chunk: a client gone before Starlette starts the stream
    # (which then never runs its ``finally``) is aborted all the same.
    watcher = on_disconnect(request, lambda: _abort_all(front, streams))
    logprobs = LogprobsFormatter(front.engine.tokenizer, chat) if req.logprobs is not None else None
    num_prompt_tokens = sum(len(ids) for ids in prompts_ids)
    if req.stream:
        return _stream(front, streams, fmt, watcher, logprobs, num_prompt_tokens)
    return await _collect(front, streams, fmt, watcher, logprobs, num_prompt_tokens)


def _check_token_ids(prompts_ids: list[list[int]], vocab_size: int, req: GenerationRequest) -> None:
    """Token ids outside the vocabulary (prompts, ``stop_token_ids``) are a 400 before anything is queued (the
    detokenizer, or ``min_tokens``'s mask, would fail on them inside the engine step)."""
    bad_stops = [t for t in req.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stops:
        raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size}); got {bad_stops[0]}",
                          "stop_token_ids")
    for i, ids in enumerate(prompts_ids):
        if min(ids) < 0 or max(ids) >= vocab_size:
            where = "messages" if req.messages is not None else "prompt" if len(prompts_ids) == 1 else f"prompt[{i}]"
            raise bad_request(f"{where}: token ids must be in [0, {vocab_size}); got min {min(ids)}, max {max(ids)}",
                              where)


async def _add_all(front, req: GenerationRequest, prompts_ids, params, request_id: str) -> list:
    """Queue every choice (each prompt's first sample first), in choice order; on a refusal abort what was queued."""
    field_name = "messages" if req.messages is not None else "prompt"
    streams: list = [None] * req.num_choices
    share = front.engine.config.enable_prefix_caching
    try:
        for rounds in ((0,), range(1, req.n)):
            for i, ids in enumerate(prompts_ids):
                if rounds and rounds[0] == 1 and share and len(ids) >= front.engine.config.block_size:
                    await streams[i * req.n].wait_first_event()  # its full prompt blocks are in the cache now
                for j in rounds:
                    index = i * req.n + j
                    streams[index] = await front.add(ids, params[i][j], req.stop, request_id=f"{request_id}-{index}")
    except RequestRejected as exc:
        _abort_all(front, streams)
        raise APIError(400, str(exc), param=field_name, code="context_length_exceeded") from None
    except ValueError as exc:
        _abort_all(front, streams)
        raise bad_request(str(exc), field_name) from None
    except BaseException:
        _abort_all(front, streams)
        raise
    return streams


def _abort_all(front, streams: list) -> None:
    for stream in streams:
        if stream is not None and not stream.done:
            front.abort(stream.request_id)


async def _read(stream, choice: _Choice, queue: asyncio.Queue | None = None) -> _Choice:
    async for event in stream:
        choice.parts.append(event.text)
        choice.logprobs.extend(event.logprobs)
        choice.last = event
        if queue is not None:
            await queue.put((choice, event))
    return choice


async def _collect(front, streams, fmt: ResponseFormat, watcher, logprobs, num_prompt_tokens: int) -> dict:
    try:
        choices = await asyncio.gather(*[_read(stream, _Choice(i)) for i, stream in enumerate(streams)])
    finally:
        watcher.cancel()
        _abort_all(front, streams)  # this handler was cancelled: nobody will read the answer
    failed = [c.last for c in choices if c.last.finish_reason == "error"]
    if failed:
        raise _failed(failed[0], fmt.request_id)
    body = [fmt.choice(c.index, "".join(c.parts), _openai_reason(c.last.finish_reason),
                       logprobs.format(c.logprobs) if logprobs else None) for c in choices]
    return fmt.response(body, num_prompt_tokens, sum(c.last.num_output_tokens for c in choices),
                        sum(c.last.num_cached_tokens for c in choices))


async def _stream(front, streams, fmt: ResponseFormat, watcher, logprobs, num_prompt_tokens: int):
    queue: asyncio.Queue = asyncio.Queue()
    readers = [asyncio.ensure_future(_read(stream, _Choice(i), queue)) for i, stream in enumerate(streams)]
    offsets = [0] * len(streams)
    try:
        if fmt.chat:
            for i in range(len(streams)):
                yield fmt.chunk(role=True, index=i)
        open_choices, outputs, cached = len(streams), 0, 0
        while open_choices:
            choice, event = await queue.get()
            if event.text or event.logprobs:
                yield fmt.chunk(event.text, index=choice.index,
                                logprobs=logprobs.format(event.logprobs, offsets[choice.index]) if logprobs else None)
                offsets[choice.index] += len(event.text)
            if not event.finished:
                continue
            open_choices -= 1
            outputs, cached = outputs + event.num_output_tokens, cached + event.num_cached_tokens
            if event.finish_reason == "error":
                yield sse(_failed(event, fmt.request_id).body())
            else:
                yield fmt.chunk(None, _openai_reason(event.finish_reason), index=choice.index)
        if fmt.include_usage:
            yield fmt.usage_chunk(num_prompt_tokens, outputs, cached)
        yield DONE
    finally:  # also when Starlette cancels the stream because the client disconnected
        watcher.cancel()
        for reader in readers:
            reader.cancel()
        _abort_all(front, streams)


def _failed(event, request_id: str) -> APIError:
    """The 500 of a choice the engine ended with an error: the engine's own sentence (never an exception's text:
    the engine logs that, under the request id given here)."""
    return APIError(500, f"generation failed: {event.error} (request id {request_id})", code="engine_error")


def _openai_reason(reason: str) -> str:
    """OpenAI knows "stop" and "length"; an aborted request (its client is gone) reads as "stop"."""
    return "length" if reason == "length" else "stop"
