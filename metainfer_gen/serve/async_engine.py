"""An asyncio front of :class:`~metainfer_gen.llm.engine.LLMEngine`: one thread steps the engine over every open
request (continuous batching); each request reads its own queue of text deltas.

    front = AsyncLLMEngine(engine)                       # starts the engine thread
    stream = await front.add(prompt_ids, SamplingParams(max_new_tokens=16), stop=["\\n"])
    async for event in stream:                          # StreamEvent(text, finished, finish_reason, ...)
        print(event.text, end="")
    front.abort(stream.request_id)                      # any time, from any thread: ends within one engine step
    front.close()

Only the engine thread touches the engine. ``add`` and ``abort`` post commands to it, applied before each step, so
a client that goes away is aborted before the next forward and its KV blocks are back in the pool when that
step runs. Detokenization and stop strings run in the engine thread too (:mod:`metainfer_gen.llm.detokenizer`):
a stop string aborts the request at the step that produced it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time

from metainfer_gen.llm.detokenizer import IncrementalDetokenizer
from metainfer_gen.llm.sequence import SamplingParams
from metainfer_gen.serve.streams import OpenRequest, RequestStream, StreamEvent, put_all, resolve

log = logging.getLogger(__name__)
_ids = itertools.count()


class AsyncLLMEngine:
    """Drives ``engine`` from a background thread, or from the thread that calls :meth:`run_here`.

    Args:
        engine: an :class:`~metainfer_gen.llm.engine.LLMEngine` with a tokenizer; nothing else may call it.
        metrics: optional observer with ``on_added(prompt_tokens)``, ``on_tokens(n, ttft_s | None, itl_s | None)``,
            ``on_finished(reason, e2e_s)`` and ``on_step(engine)`` (see :mod:`metainfer_gen.serve.metrics`).
        idle_wait_s: how long the loop sleeps between checks when no request is open (a command wakes it).
        start_thread: run the engine loop in a thread started here (default); False leaves it to
            :meth:`run_here`, which ``metainfer-gen serve`` calls on the main thread (torch's OpenMP regions ran
            about 2x slower from another thread: see :meth:`~metainfer_gen.serve.server.LLMServer.run_forever`).
    """

    def __init__(self, engine, metrics=None, *, idle_wait_s: float = 0.5, start_thread: bool = True):
        if engine.tokenizer is None:
            raise ValueError("the server needs a checkpoint with a tokenizer (tokenizer.json)")
        self.engine = engine
        self.metrics = metrics
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._requests: dict[str, OpenRequest] = {}
        # a step's events per event loop, handed over in one call (one self-pipe wake-up, not one per request)
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._closing = False
        self.num_steps = 0
        self._num_adding = 0  # adds posted and not yet applied (the event loop's side of the admission count)
        self._adding_lock = threading.Lock()
        self.last_step_at = time.monotonic()  # the loop's last step or idle check (liveness that means progress)
        self._stopped = threading.Event()  # the loop has returned (or never ran)
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
            self._thread.start()
        else:
            self._stopped.set()

    def run_here(self, stop_when=None) -> None:
        """Run the engine loop on the calling thread until :meth:`close` (from any thread), or until
        ``stop_when()`` turns true (checked between steps and at least every ``idle_wait_s``); then abort what is
        still open. Only for a front built with ``start_thread=False``.

        Raises:
            RuntimeError: the front runs its own thread, or is already running.
        """
        if self._thread is not None or not self._stopped.is_set():
            raise RuntimeError("run_here needs a front built with start_thread=False that is not running")
        self._stopped.clear()
        self._stop_when = stop_when
        try:
            self._run()
        finally:
            if not self._closing:  # stopped by stop_when, or by an exception such as KeyboardInterrupt
                self._closing = True
                self._apply_commands()
                self._shutdown_requests()
            self._flush()
            self._stopped.set()

    def _loop(self) -> None:
        try:
            self._run()
        finally:
            self._stopped.set()

    # -- called from the event loop (or any thread) -----------------------------------------------------------
    async def add(self, prompt_token_ids: list[int], params: SamplingParams, stop=None,
                  request_id: str | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine thread accepted it.

        Raises:
            ValueError: bad ``stop`` or token ids, a duplicate id, or
                :class:`~metainfer_gen.llm.engine.RequestRejected` (too long for the context or the KV pool).
            RuntimeError: the front is closed.
        """
        if self._closing:
            raise RuntimeError("the engine front is closed")
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id or f"req-{next(_ids)}", len(prompt_token_ids))
        detokenizer = IncrementalDetokenizer(self.engine.tokenizer, prompt_token_ids, stop)  # checks ``stop``
        accepted = loop.create_future()
        with self._adding_lock:
            self._num_adding += 1
        self._post(("add", OpenRequest(stream, loop, detokenizer), list(prompt_token_ids), params, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the caller went away while the engine thread was adding
            self.abort(stream.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """End a request before the next step (a finished event, reason "abort"); unknown ids are ignored."""
        self._post(("abort", request_id))

    @property
    def num_open_requests(self) -> int:
        return len(self._requests)

    @property
    def num_unfinished(self) -> int:
        """Requests open in the engine or posted and not yet applied (any thread; ``--max-queued-requests``)."""
        return self._num_adding + len(self._requests)

    def stalled_s(self) -> float:
        """Seconds since the loop last stepped or checked for work while requests wait; 0.0 when none waits."""
        return time.monotonic() - self.last_step_at if self.num_unfinished else 0.0

    @property
    def is_alive(self) -> bool:
        """The engine loop is running (False after ``close``)."""
        return not self._stopped.is_set() and not self._closing

    def close(self, timeout_s: float = 10.0) -> None:
        """Abort every open request and stop the loop (waits up to ``timeout_s`` seconds for it)."""
        self._closing = True
        self._post(("close",))
        if self._thread is not None:
            self._thread.join(timeout_s)
            return
        if self._stopped.wait(timeout_s):  # run_here has returned, or never ran: apply the close here
            self._apply_commands()
            self._flush()

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------------------------------
    _stop_when = None

    def _run(self) -> None:
        while True:
            self.last_step_at = time.monotonic()
            running = self._apply_commands()
            self._flush()
            if not running or (self._stop_when is not None and self._stop_when()):
                return
            if not self.engine.has_unfinished_requests:
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug must not hang every client: fail the open requests, keep serving
                log.exception("engine step failed")
                for request_id in list(self._requests):
                    self._abort(request_id, "error", f"the engine step failed ({type(exc).__name__})")
                continue
            self.num_steps += 1
            self.last_step_at = time.monotonic()
            if self.metrics is not None:  # before delivering: a client that sees its answer sees the step's gauges
                self.metrics.on_step(self.engine)
            now = time.perf_counter()
            for output in outputs:
                try:
                    self._deliver(output, now)
                except Exception as exc:  # one request's detokenizing or sending failed: that request ends
                    log.exception("delivering request %s failed", output.request_id)
                    if output.request_id in self._requests:
                        self._abort(output.request_id, "error", f"delivering the output failed ({type(exc).__name__})")
            self._flush()

    def _apply_commands(self) -> bool:
        """Apply queued commands; False once closed."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1], "abort")
            else:
                self._shutdown_requests()
                return False

    def _shutdown_requests(self) -> None:
        """Abort every open request and refuse the adds still queued (the front is closing)."""
        for request_id in list(self._requests):
            self._abort(request_id, "abort")
        self._refuse_pending()

    def _refuse_pending(self) -> None:
        """After ``close``: adds that were still queued fail instead of waiting forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                request, accepted = command[1], command[-1]
                self._added()
                request.loop.call_soon_threadsafe(resolve, accepted, RuntimeError("the engine front is closed"))

    def _add(self, request: OpenRequest, token_ids: list[int], params: SamplingParams, accepted) -> None:
        try:
            self.engine.add_request(token_ids, params, request_id=request.stream.request_id)
        except Exception as exc:  # ValueError / RequestRejected: the caller's 400; anything else its 500
            self._added()
            request.loop.call_soon_threadsafe(resolve, accepted, exc)
            return
        self._requests[request.stream.request_id] = request
        self._added()
        request.loop.call_soon_threadsafe(resolve, accepted, None)
        if self.metrics is not None:
            self.metrics.on_added(len(token_ids))
            self.metrics.on_step(self.engine)

    def _added(self) -> None:
        with self._adding_lock:  # one add posted earlier has been applied or refused
            self._num_adding -= 1

    def _abort(self, request_id: str, reason: str, error: str | None = None) -> None:
        request = self._requests.pop(request_id, None)
        self.engine.abort(request_id)
        if request is not None:
            self._send(request, StreamEvent("", 0), finish_reason=reason, error=error)
            if self.metrics is not None:
                self.metrics.on_step(self.engine)  # the freed blocks show at once, even if no step follows

    def _deliver(self, output, now: float) -> None:
        request = self._requests.get(output.request_id)
        if request is None:
            return
        num_new = len(output.new_token_ids)
        request.num_output_tokens += num_new
        if self.metrics is not None:
            ttft = now - request.arrival if request.last_token_time is None else None
            itl = None if request.last_token_time is None else now - request.last_token_time
            self.metrics.on_tokens(num_new, ttft, itl)
        request.last_token_time = now
        delta = request.detokenizer.push(output.new_token_ids)
        event = StreamEvent(delta.text, num_new, num_cached_tokens=output.num_cached_tokens,
                            logprobs=output.new_logprobs)
        if delta.stopped:
            self._requests.pop(output.request_id)
            self.engine.abort(output.request_id)  # no-op when this step also finished it
            self._send(request, event, finish_reason="stop")
        elif output.finished:
            self._requests.pop(output.request_id)
            event.text += request.detokenizer.finish().text
            self._send(request, event, finish_reason=output.finish_reason.value, error=output.error)
        else:
            self._send(request, event)

    def _send(self, request: OpenRequest, event: StreamEvent, finish_reason: str | None = None,
              error: str | None = None) -> None:
        event.num_prompt_tokens = request.stream.num_prompt_tokens
        event.num_output_tokens = request.num_output_tokens
        if finish_reason is not None:
            event.finished, event.finish_reason, event.error = True, finish_reason, error
            if self.metrics is not None:
                self.metrics.on_finished(finish_reason, time.perf_counter() - request.arrival)
        self._outbox.setdefault(request.loop, []).append((request.stream._queue, event))

    def _flush(self) -> None:
        """Hand the queued events to their event loops, one call per loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
                pass
