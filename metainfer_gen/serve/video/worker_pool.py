"""The worker processes of one machine and their supervision, shared by ``serve`` (API and workers) and
``video-worker`` (workers only).

    pool = WorkerPool(make_spec, num_workers=2, store=store).start()
    pool.num_ready        # workers that loaded the model
    pool.close()          # stop them (a job left running is re-run after its lease expires, or at the next start)

A worker that dies is restarted, at most :data:`MAX_RESTARTS` times in any :data:`RESTART_WINDOW_S` seconds (a
worker that keeps dying waits until the window has moved on: the budget recovers over time; ``/health`` says when
none runs); the job it was running goes back to the queue until it has had the store's ``max_attempts`` claims, then
fails (a job that kills its worker is not retried forever). It is found by the worker's fleet-wide ``owner`` name,
so no other machine's job is touched. The supervisor thread outlives errors of the store: it logs them and retries
at its next check.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from typing import Callable

from metainfer_gen.serve.video.worker import WorkerSpec, ready_key, worker_main

MAX_RESTARTS = 3  # per worker within RESTART_WINDOW_S
RESTART_WINDOW_S = 300.0
_SUPERVISE_S = 0.5
log = logging.getLogger(__name__)
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # read by OpenMP and oneDNN/MKL when the child imports torch
_ENV_LOCK = threading.Lock()  # the environment is process-wide: one spawn at a time sets and restores it


def node_name() -> str:
    """This process's name in the fleet: host name and pid (hosts made as network namespaces share a host name)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def thread_env(num_threads: int | None):
    """Set :data:`_THREAD_VARS` to ``num_threads`` while a child is spawned, then restore them.

    A spawned child imports torch (and with it OpenMP and oneDNN) while it unpickles its target, before any of its
    own code runs; those libraries read their thread count from the environment then, so a worker told to use two
    threads by a server started under ``OMP_NUM_THREADS=1`` must get it in the environment it starts with
    (``torch.set_num_threads`` afterwards is not enough for every library). None: the environment as it is.
    """
    if not num_threads:
        yield
        return
    saved = {name: os.environ.get(name) for name in _THREAD_VARS}
    os.environ.update({name: str(num_threads) for name in _THREAD_VARS})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class WorkerPool:
    """``num_workers`` processes running :func:`~.worker.worker_main`.

    Args:
        make_spec: the :class:`~.worker.WorkerSpec` of worker ``i``.
        num_workers: how many (0: none; the pool is then empty and idle).
        store: this process's job store (to requeue or fail a dead worker's job and forget its readiness).
        max_restarts / restart_window_s: restarts a worker may have in any ``restart_window_s`` seconds.
        target: the process entry point, called with ``(spec, stop_event)`` (default :func:`~.worker.worker_main`).
    """

    def __init__(self, make_spec: Callable[[int], WorkerSpec], num_workers: int, store, *,
                 max_restarts: int = MAX_RESTARTS, restart_window_s: float = RESTART_WINDOW_S,
                 target: Callable = worker_main):
        self.make_spec, self.num_workers, self.store = make_spec, num_workers, store
        self.max_restarts, self.restart_window_s, self.target = max_restarts, restart_window_s, target
        self._restarts = [collections.deque() for _ in range(num_workers)]  # monotonic times of recent restarts
        self._handled = [False] * num_workers  # the current process's death has been recorded in the store
        self._processes: list = []
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._stop = self._context = None

    def start(self) -> "WorkerPool":
        """Spawn the workers (they load the model in the background) and the supervisor thread."""
        import multiprocessing

        self._context = multiprocessing.get_context("spawn")
        self._stop = self._context.Event()
        self._processes = [self._spawn(i) for i in range(self.num_workers)]
        self._supervisor = threading.Thread(target=self._supervise, name="video-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def _spawn(self, index: int):
        spec = self.make_spec(index)
        process = self._context.Process(target=self.target, args=(spec, self._stop), name=f"video-worker-{index}",
                                        daemon=True)
        with _ENV_LOCK, thread_env(spec.num_threads):
            process.start()
        return process

    def _supervise(self) -> None:
        while not self._closing.wait(_SUPERVISE_S):
            try:
                self._check_workers()
            except Exception:  # noqa: BLE001 - a store error must not end supervision: retry at the next check
                log.exception("the video worker supervisor's check failed; retrying in %s s", _SUPERVISE_S)

    def _check_workers(self) -> None:
        for index, process in enumerate(self._processes):
            if process.is_alive() or process.exitcode is None or self._closing.is_set():
                continue
            if not self._handled[index]:  # once per death, until the store has taken it
                owner = self.make_spec(index).owner
                self.store.requeue_running_of(owner, f"the worker process died running it (last exit code "
                                                     f"{process.exitcode})")
                self.store.delete_meta(ready_key(owner))  # not ready until the replacement has loaded the model
                self._handled[index] = True
            recent, now = self._restarts[index], time.monotonic()
            while recent and now - recent[0] > self.restart_window_s:
                recent.popleft()
            if len(recent) < self.max_restarts:
                recent.append(now)
                self._processes[index] = self._spawn(index)
                self._handled[index] = False

    @property
    def supervising(self) -> bool:
        """The supervisor thread runs (False before :meth:`start` and after :meth:`close`)."""
        return self._supervisor is not None and self._supervisor.is_alive()

    def process(self, index: int):
        """Worker ``index``'s current process (a replacement once the supervisor restarted it)."""
        return self._processes[index]

    @property
    def num_alive(self) -> int:
        return sum(p.is_alive() for p in self._processes)

    @property
    def all_exited(self) -> bool:
        """True when workers were started and every one has exited."""
        return bool(self._processes) and not any(p.is_alive() or p.exitcode is None for p in self._processes)

    @property
    def num_ready(self) -> int:
        """Workers of this start that have loaded the model."""
        return sum(self.store.get_meta(ready_key(self.make_spec(i).owner)) is not None
                   for i in range(self.num_workers))

    def close(self, timeout_s: float = 3.0) -> None:
        """Stop the workers; idempotent. A running job stops at its next step (its lease then lapses); a worker
        still loading its model after ``timeout_s`` seconds is killed (it holds no job)."""
        self._closing.set()
        if self._supervisor is not None:  # first: a restart it is making lands in the list stopped below
            self._supervisor.join(timeout_s)
            self._supervisor = None
        if self._stop is not None:
            self._stop.set()
        for process in self._processes:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join(timeout_s)
        for index in range(len(self._processes)):  # a shared store would keep a stopped node's keys forever
            self.store.delete_meta(ready_key(self.make_spec(index).owner))
        self._processes = []
