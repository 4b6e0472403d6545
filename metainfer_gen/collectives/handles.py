"""Asynchronous collective handles, and the per-communicator worker thread that runs them in call order.

Every rank issues collectives in the same order; one worker thread per communicator preserves that order while the
caller goes on computing (torch kernels release the GIL, so the exchange and the next matmul chunk overlap).
The design follows ``torch.distributed.Work`` (``wait`` / ``is_completed``) with a timeout on ``wait``.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

__all__ = ["BackendWork", "Work", "Worker"]


class Work:
    """Handle of one asynchronous collective.

    ``wait(timeout=None)`` blocks until it finished and re-raises its exception (a
    :class:`~metainfer_gen.collectives.shm.CollectiveTimeout` when a peer died); ``is_completed()`` polls.
    """

    def __init__(self, result: Any = None):
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._result = result

    def _finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        if exc is None and result is not None:
            self._result = result
        self._exc = exc
        self._done.set()

    def is_completed(self) -> bool:
        """True once the collective finished (successfully or not); never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the output tensor.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (the collective itself keeps running).
            Exception: whatever the collective raised.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"collective not finished within {timeout} s")
        if self._exc is not None:
            raise self._exc
        return self._result

    @classmethod
    def completed(cls, result: Any = None) -> "Work":
        """A handle that is already done (for paths that ran synchronously)."""
        work = cls(result)
        work._done.set()
        return work


class BackendWork(Work):
    """Wraps a ``torch.distributed`` async work object (gloo/NCCL fallback path) in the same interface."""

    def __init__(self, work, result: Any = None, after: Callable[[], None] | None = None):
        super().__init__(result)
        self._work, self._after = work, after

    def is_completed(self) -> bool:
        """True once the backend reports completion."""
        return self._done.is_set() or self._work.is_completed()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait on the backend work (``timeout`` seconds, None for the backend's own) and return the output."""
        if not self._done.is_set():
            import datetime

            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(datetime.timedelta(seconds=timeout))
            if self._after is not None:
                self._after()
            self._done.set()
        return self._result


class Worker:
    """A daemon thread running submitted functions one at a time, in submission order (started on first use)."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._cond = threading.Condition()

    def submit(self, fn: Callable[..., Any], *args: Any, result: Any = None) -> Work:
        """Queue ``fn(*args)``; the handle's ``wait()`` returns ``result`` (or what ``fn`` returned, if not None)."""
        work = Work(result)
        with self._cond:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put((fn, args, work))
        return work

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, work = item
            try:
                work._finish(fn(*args))
            except BaseException as exc:  # handed to the waiter
                work._finish(exc=exc)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def drain(self) -> None:
        """Block until every submitted function has run (failures stay with their handles)."""
        if not self._pending:  # the common case (no async work in flight) skips the lock
            return
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def stop(self) -> None:
        """End the thread after the queued functions (joins for up to 5 s)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
