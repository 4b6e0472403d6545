"""The demo's LLM tab behind the server's async front, so concurrent browser sessions share the engine's batches.

Gradio runs each click in a worker thread; every call here queues its request on one
:class:`~metainfer_gen.serve.async_engine.AsyncLLMEngine` (the engine thread steps all open requests together,
exactly as ``metainfer-gen serve`` does) and waits on its own event loop for the text.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from metainfer_gen.apps.demo_limits import InputError


@dataclass(slots=True)
class Completion:
    """One finished completion as the tab shows it (times in seconds; None when fewer than 1 / 2 tokens)."""

    text: str
    num_tokens: int
    finish_reason: str
    ttft: float | None
    mean_token_latency: float | None

    @property
    def stats_text(self) -> str:
        """"6 tokens, TTFT 12.3 ms, 250.0 tokens/s after the first, finish: length"."""
        parts = [f"{self.num_tokens} tokens"]
        if self.ttft is not None:
            parts.append(f"TTFT {self.ttft * 1000:.1f} ms")
        if self.mean_token_latency:
            parts.append(f"{1.0 / self.mean_token_latency:.1f} tokens/s after the first")
        return ", ".join(parts + [f"finish: {self.finish_reason}"])


class DemoLLM:
    """A :class:`~metainfer_gen.pipelines.TextGenerationPipeline` served through the async front.

    The front (and its engine thread) starts on the first call; :meth:`close` stops it. Nothing else may step the
    pipeline's engine while the front runs.
    """

    def __init__(self, pipe):
        self.pipe = pipe
        self._front = None
        self._lock = threading.Lock()

    @property
    def front(self):
        """The async front, started on first use."""
        with self._lock:
            if self._front is None:
                from metainfer_gen.serve.async_engine import AsyncLLMEngine

                self._front = AsyncLLMEngine(self.pipe.engine)
            return self._front

    def complete(self, prompt: str, max_new_tokens: int, temperature: float) -> Completion:
        """Generate for ``prompt`` (blocking this thread; other calls join the same engine steps).

        Raises:
            InputError: an empty prompt, or one the engine refuses (too long for the context or the KV pool).
        """
        from metainfer_gen.llm.sequence import SamplingParams

        try:
            ids = self.pipe.engine.encode(prompt)
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        return asyncio.run(self._complete(ids, params))

    async def _complete(self, ids: list[int], params) -> Completion:
        start = time.perf_counter()
        try:
            stream = await self.front.add(ids, params)
        except ValueError as exc:  # RequestRejected included
            raise InputError(f"the LLM refused the prompt: {exc}") from None
        parts, times, last = [], [], None
        async for event in stream:
            parts.append(event.text)
            times.extend([time.perf_counter()] * event.num_new_tokens)
            last = event
        if last.finish_reason == "error":
            raise InputError(f"the LLM failed: {last.error}")
        ttft = times[0] - start if times else None
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return Completion("".join(parts), last.num_output_tokens, last.finish_reason, ttft, tpot)

    def close(self) -> None:
        """Stop the front's engine thread (open requests end with reason "abort"); idempotent."""
        with self._lock:
            if self._front is not None:
                self._front.close()
                self._front = None
