"""What the engine thread hands the event loop: one request's events (:class:`StreamEvent`) in its
:class:`RequestStream`, and the callbacks that run on the loop (:func:`put_all`, :func:`resolve`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class StreamEvent:
    """What one engine step gave one request.

    Attributes:
        text: new text (may be "" while an incomplete character or a possible stop string is held back).
        num_new_tokens: tokens this step added.
        finished: last event of the request; ``finish_reason`` is then "stop", "length", "abort" (aborted, e.g.
            the client went away) or "error" (``error`` says why).
        num_prompt_tokens, num_output_tokens: counts so far (usage).
        logprobs: the :class:`~metainfer_gen.llm.logits_processors.TokenLogprobs` of this step's tokens, when
            the request asked for them.
    """

    text: str
    num_new_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list = field(default_factory=list)


@dataclass(eq=False)
class RequestStream:
    """One request's events, in order; iterate with ``async for`` (ends after the finished event)."""

    request_id: str
    num_prompt_tokens: int
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False
    _held: list = field(default_factory=list)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamEvent:
        if self.done:
            raise StopAsyncIteration
        event = self._held.pop(0) if self._held else await self._queue.get()
        self.done = event.finished
        return event

    async def wait_first_event(self) -> None:
        """Wait until the engine sent this request's first event (its prompt is computed), keeping it for the
        next read."""
        if not self._held and not self.done:
            self._held.append(await self._queue.get())


def put_all(items: list) -> None:
    """On the event loop: put each ``(queue, event)`` of one engine step."""
    for queue_, event in items:
        queue_.put_nowait(event)


def resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    """On the event loop: settle an ``add``'s future (``exc`` None: accepted), unless its caller is gone."""
    if future.done():  # the caller was cancelled meanwhile
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


@dataclass(eq=False)
class OpenRequest:
    """Engine-thread state of one open request of :class:`~metainfer_gen.serve.async_engine.AsyncLLMEngine`:
    its stream, the event loop it is read on, its detokenizer, and its timings (``time.perf_counter`` seconds)."""

    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    detokenizer: object  # an IncrementalDetokenizer
    arrival: float = field(default_factory=time.perf_counter)
    last_token_time: float | None = None
    num_output_tokens: int = 0
