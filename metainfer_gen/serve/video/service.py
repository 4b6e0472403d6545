"""The video side of the server: the data folder, its job store, the worker processes and their supervision.

    service = VideoService.start(VideoServeConfig(data_dir="data", limits=DemoLimits(), num_workers=2))
    service.submit(body)          # -> Job (checked, queued)
    service.close()               # stop the workers (jobs left running are re-run by the next start)

At start the folder is made consistent with a crash at any earlier moment: jobs left ``in_progress`` go back to
the queue, half-written clips (the exporter's hidden temporaries) are removed; finished clips stay as they are.
"""

from __future__ import annotations

import fcntl
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from metainfer_gen.serve.video.jobs import STORE_NAME, Job, JobStore
from metainfer_gen.serve.video.request import RequestChecks, VideoRequest, parse_video_request
from metainfer_gen.serve.video.worker import CLIPS, UPLOADS, WorkerSpec, worker_main

DEFAULT_MAX_UPLOAD_BYTES = 20 << 20  # the demo's max_upload_mb
_MAX_RESTARTS = 3  # per worker: a worker that keeps dying is left dead (/health then says so)
_SUPERVISE_S = 0.5


@dataclass(slots=True)
class VideoServeConfig:
    """How to serve video.

    Args:
        data_dir: folder of the job store, clips and uploads (created when missing).
        limits: the request bounds (``apps.demo_limits.DemoLimits`` or an object with its ``check_*`` methods).
        model: pipeline folder or hub id; None: the embedded model.
        num_workers: worker processes (one per GPU; on the CPU the cores are split between them).
        num_threads: CPU threads per worker; None: the usable cores divided by ``num_workers`` (at least 1).
        device / dtype: the workers' (None: CUDA GPU ``i`` for worker ``i`` when available, else the CPU).
        served_model_name: the ``model`` name of the video API (default the folder's name).
        lora: ``(name, weight) -> (path, weight)`` for names in the LoRA folder (None: no LoRAs).
        max_upload_bytes: largest multipart body (the reference image with the fields).
        cache_names: the ``cache`` policies requests may name (default: ``off`` and every step-cache policy).
    Raises:
        ValueError: ``num_workers`` or ``num_threads`` < 1, or no limits.
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

    def __post_init__(self) -> None:
        if self.num_workers < 1 or (self.num_threads is not None and self.num_threads < 1):
            raise ValueError(f"num_workers and num_threads must be >= 1; got {self.num_workers}, "
                             f"{self.num_threads}")
        if self.limits is None:
            raise ValueError("limits are required (e.g. metainfer_gen.apps.demo_limits.DemoLimits())")
        if self.max_upload_bytes < 1:
            raise ValueError(f"max_upload_bytes must be >= 1; got {self.max_upload_bytes}")


def _model_facts(model) -> tuple[str, Any, dict[str, Any]]:
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
    """The store, the workers and the request checks of one data folder (one server at a time per folder, held by
    :func:`lock_data_dir`)."""

    def __init__(self, config: VideoServeConfig):
        from metainfer_gen.video.cache.policies import policy_names

        self.config = config
        self.data_dir = Path(config.data_dir).resolve()
        for sub in ("", CLIPS, UPLOADS):
            (self.data_dir / sub).mkdir(parents=True, exist_ok=True)
        self._lock = lock_data_dir(self.data_dir)  # before the re-queue below touches another server's jobs
        self.store = JobStore(self.data_dir / STORE_NAME)
        self.num_requeued = self.store.requeue_interrupted()
        self.store.clear_meta()
        for stale in (self.data_dir / CLIPS).glob(".*"):  # the exporter's temporaries of a killed render
            stale.unlink(missing_ok=True)
        name, rules, defaults = _model_facts(config.model)
        self.model_name = config.served_model_name or name
        self.checks = RequestChecks(config.limits, rules, defaults, self.model_name,
                                    config.cache_names or ("off", *policy_names()), config.lora)
        self._stop = None
        self._reported_defaults = False
        self._workers: list = []
        self._restarts = [0] * config.num_workers
        self._supervisor: threading.Thread | None = None
        self._closing = threading.Event()

    @classmethod
    def start(cls, config: VideoServeConfig) -> "VideoService":
        """Open the folder and start the workers (they load the model in the background)."""
        import multiprocessing

        service = cls(config)
        context = multiprocessing.get_context("spawn")
        service._stop = context.Event()
        service._context = context
        service._workers = [service._spawn(i) for i in range(config.num_workers)]
        service._supervisor = threading.Thread(target=service._supervise, name="video-supervisor", daemon=True)
        service._supervisor.start()
        return service

    def _spawn(self, index: int):
        config = self.config
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = config.num_threads or max(1, cores // config.num_workers)
        spec = WorkerSpec(index, str(self.data_dir), None if config.model is None else str(config.model),
                          config.device, config.dtype, threads, os.getpid())
        process = self._context.Process(target=worker_main, args=(spec, self._stop), name=f"video-worker-{index}",
                                        daemon=True)
        process.start()
        return process

    def _supervise(self) -> None:
        """Restart a worker that died (its running job is recorded as failed); bounded per worker."""
        while not self._closing.wait(_SUPERVISE_S):
            for index, process in enumerate(self._workers):
                if process.is_alive() or process.exitcode is None or self._closing.is_set():
                    continue
                self.store.fail_running_of(index, f"the worker process exited with code {process.exitcode}")
                self.store.delete_meta(f"ready:{index}")  # not ready until the replacement has loaded the model
                if self._restarts[index] < _MAX_RESTARTS:
                    self._restarts[index] += 1
                    self._workers[index] = self._spawn(index)

    @property
    def ready(self) -> bool:
        """True once a worker has loaded the model (its rules and call defaults are then known)."""
        _ = self.rules
        return self._reported_defaults

    @property
    def num_ready_workers(self) -> int:
        """Workers of this start that have loaded the model."""
        return sum(self.store.get_meta(f"ready:{i}") is not None for i in range(self.config.num_workers))

    def wait_ready(self, timeout_s: float = 300.0, all_workers: bool = False) -> None:
        """Block until :attr:`ready` (``all_workers``: until every worker has loaded the model). Raises
        TimeoutError after ``timeout_s`` s, RuntimeError when every worker has exited."""
        import time

        deadline = time.monotonic() + timeout_s
        while not self.ready or (all_workers and self.num_ready_workers < self.config.num_workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no video worker loaded the model within {timeout_s} s")
            if self._workers and not any(p.is_alive() or p.exitcode is None for p in self._workers):
                raise RuntimeError("every video worker exited before loading the model")
            time.sleep(0.05)

    @property
    def num_alive_workers(self) -> int:
        return sum(p.is_alive() for p in self._workers)

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
            if reported is not None:
                self.checks.defaults = {**reported, **self.checks.defaults}
                self._reported_defaults = True
                self.checks.loading = False
        return self.checks.rules

    def submit(self, body: dict[str, Any], image_bytes: bytes | None = None) -> Job:
        """Check ``body`` (and the uploaded reference image), store the image, queue the job.

        Raises:
            APIError: 400 naming the field, before anything is written; 503 while the model is loading.
        """
        from metainfer_gen.serve.video.uploads import store_image

        _ = self.ready  # picks up what a worker reported since
        job_id = f"video_{uuid.uuid4()}"
        request = parse_video_request(body, self.checks, image=f"{job_id}.png" if image_bytes is not None else None)
        if image_bytes is not None:
            store_image(image_bytes, self.data_dir / UPLOADS / request.image, self.config.limits)
        return self.store.add(job_id, request.to_dict())

    def clip_path(self, job: Job) -> Path:
        return self.data_dir / CLIPS / f"{job.id}.mp4"

    def remove_files(self, job: Job) -> None:
        """Delete a job's clip and uploaded image (a finished job being deleted)."""
        self.clip_path(job).unlink(missing_ok=True)
        image = VideoRequest.from_dict(job.request).image
        if image:
            (self.data_dir / UPLOADS / image).unlink(missing_ok=True)

    def close(self, timeout_s: float = 3.0) -> None:
        """Stop the workers and close the store; idempotent. A running job stops at its next step and stays
        ``in_progress`` (the next start re-runs it); a worker still loading its model after ``timeout_s`` seconds
        is killed (it holds no job)."""
        self._closing.set()
        if self._supervisor is not None:  # first: a restart it is making lands in the list stopped below
            self._supervisor.join(timeout_s)
            self._supervisor = None
        if self._stop is not None:
            self._stop.set()
        for process in self._workers:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join(timeout_s)
        self._workers = []
        self.store.close()
        self._lock.close()
