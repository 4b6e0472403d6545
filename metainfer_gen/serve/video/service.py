"""The video side of the server: the job store, the clips folder, the worker processes and the request checks.

    service = VideoService.start(VideoServeConfig(data_dir="data", limits=DemoLimits(), num_workers=2))
    service.submit(body)          # -> Job (checked, queued)
    service.close()               # stop the workers (jobs left running are re-run by the next start)

With the default store (SQLite in ``data_dir``) one server owns the folder, and at start makes it consistent with a
crash at any earlier moment: jobs left ``in_progress`` go back to the queue, half-written clips (hidden
temporaries) are removed; finished clips stay as they are. With a shared store (``job_store="postgresql://..."``)
many servers share the queue and the clips folder: none may requeue another's running jobs, so a dead machine's
jobs come back when their leases expire (:meth:`~.jobs.JobStore.requeue_expired`).
"""

from __future__ import annotations

import fcntl
import functools
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from metainfer_gen.serve.errors import retry_later
from metainfer_gen.serve.video.jobs import (DEFAULT_LEASE_S, DEFAULT_MAX_ATTEMPTS, Job, JobStatus,
                                            JobStoreUnavailable)
from metainfer_gen.serve.video.request import RequestChecks, parse_video_request
from metainfer_gen.serve.video.sqlite_store import STORE_NAME
from metainfer_gen.serve.video.stores import open_job_store, store_scheme
from metainfer_gen.serve.video.worker import CLIPS, UPLOADS, WorkerSpec
from metainfer_gen.serve.video.worker_pool import WorkerPool, node_name, usable_cores

DEFAULT_MAX_UPLOAD_BYTES = 20 << 20  # the demo's max_upload_mb
STORE_THREADS = 4  # the routes' store calls: apart from asyncio's default threads (tokenizing) so neither starves


@dataclass(slots=True)
class VideoServeConfig:
    """How to serve video.

    Args:
        data_dir: folder of the local job store (SQLite), clips and uploads (created when missing).
        limits: the request bounds (``apps.demo_limits.DemoLimits`` or an object with its ``check_*`` methods).
        model: pipeline folder or hub id; None: the embedded model.
        num_workers: worker processes (one per GPU; on the CPU the cores are split between them); 0: an API-only
            node (the fleet's workers run elsewhere).
        job_store: None (SQLite in ``data_dir``) or a store address, e.g. ``postgresql://user@host/db`` (shared).
        clips_dir: where clips and uploads live (default ``data_dir/clips`` and ``data_dir/uploads``); with a
            shared store, a folder every machine mounts (required then).
        lease_s / max_attempts: a claim's lease (seconds) and the claims a job may take.
        store_busy_timeout_s: how long the server's store calls wait for another process's SQLite write lock
            before the route answers 503 with ``Retry-After``, seconds (None: the store's 30 s).
        num_threads: CPU threads per worker; None: the usable cores divided by ``num_workers`` (at least 1).
        device / dtype: the workers' (None: CUDA GPU ``i`` for worker ``i`` when available, else the CPU).
        served_model_name: the ``model`` name of the video API (default the folder's name).
        lora: ``(name, weight) -> (path, weight)`` for names in the LoRA folder (None: no LoRAs).
        max_upload_bytes: largest multipart body (the reference image with the fields).
        cache_names: the ``cache`` policies requests may name (default: ``off`` and every step-cache policy).
        preset: the workers' ``enable_acceleration`` preset (None: none); a request's ``cache`` "off" then means
            the preset's step cache, another policy replaces it for that request.
    Raises:
        ValueError: ``num_workers`` < 0, ``num_threads`` < 1, no limits, an unknown store scheme, or a shared store
            without ``clips_dir``.
    """

    data_dir: str | Path
    limits: Any
    model: str | Path | None = None
    num_workers: int = 1
    num_threads: int | None = None
    device: str | None = None
    dtype: str | None = None
    served_model_name: str | None = None
    lora: Callable[[str, float], tuple[str, float]] | None = None
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    cache_names: tuple[str, ...] = field(default_factory=tuple)
    job_store: str | None = None
    clips_dir: str | Path | None = None
    lease_s: float = DEFAULT_LEASE_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    preset: str | None = None
    store_busy_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 0 or (self.num_threads is not None and self.num_threads < 1):
            raise ValueError(f"num_workers must be >= 0 and num_threads >= 1; got {self.num_workers}, "
                             f"{self.num_threads}")
        if self.job_store is not None and store_scheme(self.job_store) != "sqlite" and self.clips_dir is None:
            raise ValueError("a shared job store needs a clips folder every machine mounts: give --clips-dir")
        if self.limits is None:
            raise ValueError("limits are required (e.g. metainfer_gen.apps.demo_limits.DemoLimits())")
        if self.store_busy_timeout_s is not None and not self.store_busy_timeout_s > 0:
            raise ValueError(f"store_busy_timeout_s must be None or > 0; got {self.store_busy_timeout_s}")
        if self.max_upload_bytes < 1:
            raise ValueError(f"max_upload_bytes must be >= 1; got {self.max_upload_bytes}")


def model_facts(model) -> tuple[str, Any, dict[str, Any]]:
    """(name, rules or None, default settings) of a model folder, read without loading weights."""
    from metainfer_gen.pipelines.loading import default_model_path, model_settings
    from metainfer_gen.video.rules import VideoRules

    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        return str(model), None, {}
    return path.name, VideoRules.from_model_dir(path), model_settings(path)


class DataDirInUse(RuntimeError):
    """Another server holds the data folder (its lock file): two would re-queue and render each other's jobs."""


def lock_data_dir(path: Path):
    """The open lock file of ``path`` (``.lock``), held with an exclusive ``flock`` until it is closed; the kernel
    drops it when the process dies, ``kill -9`` included.

    Raises:
        DataDirInUse: another process holds it.
    """
    path.mkdir(parents=True, exist_ok=True)
    handle = open(path / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise DataDirInUse(f"the data folder {path} is in use by another server: stop it, or give this one its own "
                           "--data-dir") from None
    return handle


class VideoService:
    """The store, the workers and the request checks of one server. With the default SQLite store one server at a
    time holds the data folder (:func:`lock_data_dir`); a shared store takes any number."""

    def __init__(self, config: VideoServeConfig):
        from metainfer_gen.video.cache.policies import policy_names

        self.config = config
        self.data_dir = Path(config.data_dir).resolve()
        self.clips_dir = Path(config.clips_dir).resolve() if config.clips_dir is not None else self.data_dir / CLIPS
        self.uploads_dir = self.clips_dir / UPLOADS if config.clips_dir is not None else self.data_dir / UPLOADS
        for folder in (self.data_dir, self.clips_dir, self.uploads_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.store_address = config.job_store or str(self.data_dir / STORE_NAME)
        self.shared = store_scheme(self.store_address) != "sqlite"
        # one server per local store: taken before the re-queue below touches another server's jobs
        self._lock = None if self.shared else lock_data_dir(self.data_dir)
        self.store = open_job_store(self.store_address, config.lease_s, config.max_attempts,
                                    config.store_busy_timeout_s)
        self.node = node_name()
        self.num_requeued = 0
        if not self.shared:
            self.num_requeued = self.store.requeue_interrupted()
            self.store.clear_meta()
            for stale in self.clips_dir.glob(".*"):  # the exporter's temporaries of a killed render
                stale.unlink(missing_ok=True)
        name, rules, defaults = model_facts(config.model)
        self.model_name = config.served_model_name or name
        self.checks = RequestChecks(config.limits, rules, defaults, self.model_name,
                                    config.cache_names or ("off", *policy_names()), config.lora)
        self._reported_defaults = False
        self._submitting = threading.Lock()  # the queue bound's count and the insert, one submit at a time
        self.pool = WorkerPool(self.worker_spec, config.num_workers, self.store)
        self.executor = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="job-store")
        self._closed = False

    @classmethod
    def start(cls, config: VideoServeConfig) -> "VideoService":
        """Open the store and start the workers (they load the model in the background)."""
        service = cls(config)
        service.pool.start()
        return service

    def worker_spec(self, index: int) -> WorkerSpec:
        """The spec of this server's worker ``index``."""
        config = self.config
        threads = config.num_threads or max(1, usable_cores() // max(1, config.num_workers))
        return WorkerSpec(index, self.store_address, str(self.clips_dir), str(self.uploads_dir),
                          f"{self.node}/{index}", None if config.model is None else str(config.model),
                          config.device, config.dtype, threads, os.getpid(), config.lease_s, config.max_attempts,
                          config.preset)

    @property
    def ready(self) -> bool:
        """True once a worker (of this server, or of the fleet) has loaded the model: its rules and call defaults
        are then known."""
        _ = self.rules
        return self._reported_defaults

    @property
    def num_ready_workers(self) -> int:
        """Workers of this start that have loaded the model."""
        return self.pool.num_ready

    def wait_ready(self, timeout_s: float = 300.0, all_workers: bool = False) -> None:
        """Block until :attr:`ready` (``all_workers``: until every worker has loaded the model). Raises
        TimeoutError after ``timeout_s`` s, RuntimeError when every worker has exited."""
        import time

        deadline = time.monotonic() + timeout_s
        while not self.ready or (all_workers and self.num_ready_workers < self.config.num_workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no video worker loaded the model within {timeout_s} s")
            if self.pool.all_exited:
                raise RuntimeError("every video worker exited before loading the model")
            time.sleep(0.05)

    @property
    def num_alive_workers(self) -> int:
        return self.pool.num_alive

    @property
    def rules(self):
        """The model's rules: from its folder, else from the first worker that loaded it (None until then)."""
        if self.checks.rules is None:
            from metainfer_gen.video.rules import VideoRules

            found = self.store.get_meta("rules")
            if found is not None:
                self.checks.rules = VideoRules(**found)
        if not self._reported_defaults:  # the call defaults a worker read from the loaded pipeline
            reported = self.store.get_meta("defaults")
            if reported is not None:  # they win: a preset's (a fused step LoRA's steps and guidance) are in them
                self.checks.defaults = {**self.checks.defaults, **reported}
                self._reported_defaults = True
                self.checks.loading = False
        return self.checks.rules

    def submit(self, body: dict[str, Any], image_bytes: bytes | None = None, max_queued: int | None = None) -> Job:
        """Check ``body`` (and the uploaded reference image), store the image, queue the job. ``max_queued``: the
        jobs the queue may hold (``--max-queued-videos``; None: unbounded); exact within this server (its submits
        take turns), approximate across the servers of a fleet.

        Raises:
            APIError: 400 naming the field, before anything is written; 503 while the model is loading; 429 with
                ``Retry-After`` when the queue is full (nothing written).
        """
        from metainfer_gen.serve.video.uploads import store_image

        _ = self.ready  # picks up what a worker reported since
        job_id = f"video_{uuid.uuid4()}"
        request = parse_video_request(body, self.checks, image=f"{job_id}.png" if image_bytes is not None else None)
        with self._submitting:
            if max_queued is not None:
                queued = self.store.counts()[JobStatus.QUEUED]
                if queued >= max_queued:
                    raise retry_later(429, f"the video queue is full ({queued} jobs wait; --max-queued-videos "
                                           f"{max_queued})", "queue_full")
            if image_bytes is not None:
                store_image(image_bytes, self.uploads_dir / request.image, self.config.limits)
            return self.store.add(job_id, request.to_dict())

    async def call(self, fn: Callable, *args):
        """``fn(*args)`` on the store threads (a locked store must hold up these calls only, never the event loop).

        Raises:
            APIError: 503 with ``Retry-After`` when the store stayed locked (SQLite's busy timeout) or unreachable;
                whatever ``fn`` raises otherwise.
        """
        import asyncio
        import sqlite3

        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            raise retry_later(503, "the job store is locked by another process", "store_busy") from None
        except JobStoreUnavailable:
            raise retry_later(503, "the job store cannot be reached", "store_unavailable") from None

    def clip_path(self, job: Job) -> Path:
        return self.clips_dir / f"{job.id}.mp4"

    def remove_files(self, job: Job) -> None:
        """Delete a job's clip and uploaded image (a finished job being deleted)."""
        self.clip_path(job).unlink(missing_ok=True)
        image = job.request.get("image")  # not from_dict: an unreadable row is deleted too
        if image:
            (self.uploads_dir / image).unlink(missing_ok=True)

    def close(self, timeout_s: float = 3.0) -> None:
        """Stop the workers and close the store; idempotent. A running job stops at its next step and stays
        ``in_progress`` (the next start, or the lease's expiry, re-runs it); a worker still loading its model
        after ``timeout_s`` seconds is killed (it holds no job)."""
        if self._closed:
            return
        self._closed = True
        self.pool.close(timeout_s)
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        if self._lock is not None:
            self._lock.close()
