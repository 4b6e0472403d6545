"""One video worker process: load the model once, then take jobs from the store until told to stop.

A server (or ``metainfer-gen video-worker``) starts :func:`worker_main` in fresh (``spawn``) processes, one per
GPU, or on the CPU with the cores split between them. A claimed job is held under a lease that a heartbeat thread
renews every third of the lease; each denoising step's ``callback_on_step_end`` records the progress and reads the
job's cancel flag in one statement, so a cancel sent to any server of the fleet (or the loss of the lease) stops
the job at the next step. A job that raises records its error and the worker takes the next one.

The clip is written under a hidden per-attempt name in the shared clips folder (temporary, fsync, rename), then,
only after a renewal proves the lease still ours, renamed to ``<id>.mp4`` and the job marked completed: a renewal
keeps every other worker from claiming the job for a whole lease, so a worker whose lease was taken over never
writes the clip, and a kill at any moment only re-runs the job.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from metainfer_gen.serve.video.jobs import DEFAULT_LEASE_S, DEFAULT_MAX_ATTEMPTS, Job
from metainfer_gen.serve.video.request import VideoRequest
from metainfer_gen.serve.video.stores import open_job_store

IDLE_WAKE_S = 1.0  # an idle worker wakes at least this often (stop flag, expired leases) between wake-ups
CLIPS = "clips"
UPLOADS = "uploads"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process needs (picklable: it crosses to a spawned process).

    Attributes:
        index: the worker's number on its machine (0-based; the ``worker`` column of its jobs).
        store: the job store's address (a SQLite path or a ``postgresql://`` URL).
        clips_dir / uploads_dir: where clips go and reference images are read (shared storage in a fleet).
        owner: the worker's fleet-wide name, ``"<node>/<index>"`` (the ``owner`` column of its jobs).
        model: pipeline folder or hub id (None: the embedded model). device: "cpu", "cuda", "cuda:N" or None
            (GPU ``index`` of the visible ones when CUDA is available, else the CPU). dtype: torch dtype name or
            None (the pipeline's default). num_threads: CPU threads of this process (None: torch's default).
        parent_pid: the starting process's pid; the worker exits when its parent is gone.
        lease_s / max_attempts: the store's lease length (seconds) and attempt cap.
        preset: ``enable_acceleration`` preset of the loaded pipeline (None: none).
    """

    index: int
    store: str
    clips_dir: str
    uploads_dir: str
    owner: str
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    num_threads: int | None = None
    parent_pid: int = 0
    lease_s: float = DEFAULT_LEASE_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    preset: str | None = None


def ready_key(owner: str) -> str:
    """The store's meta key a worker sets once its model is loaded (its value: the worker's pid)."""
    return f"ready:{owner}"


class JobStopped(Exception):
    """Raised from the step callback: the job was cancelled."""


class LeaseLost(Exception):
    """Raised from the step callback: another worker took the job over (this one's lease expired)."""


class WorkerStopping(Exception):
    """Raised from the step callback: the server is stopping; the job stays ``in_progress`` and the next start
    re-runs it."""


def _die_with_parent(parent_pid: int) -> None:
    """Linux: get SIGKILL when the parent dies (a ``kill -9`` of the server must not leave renderers behind)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if parent_pid and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def worker_main(spec: WorkerSpec, stop) -> None:
    """Process entry point: serve jobs until ``stop`` (a multiprocessing Event) is set or the parent dies."""
    _die_with_parent(spec.parent_pid)
    worker = VideoWorker(spec, stop)
    try:
        worker.store.listen()  # before the first claim: a job queued in between still wakes this worker
        while not stop.is_set() and os.getppid() == spec.parent_pid:
            if not worker.run_one():
                worker.store.wait_for_work(IDLE_WAKE_S)
    finally:
        worker.store.close()


class VideoWorker:
    """The loaded pipelines of one worker and the job loop's body (also usable in-process, e.g. in tests)."""

    def __init__(self, spec: WorkerSpec, stop=None):
        import torch

        from metainfer_gen.pipelines.image_to_video import ImageToVideoPipeline
        from metainfer_gen.pipelines.text_to_video import TextToVideoPipeline

        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.stop = stop
        self.clips_dir, self.uploads_dir = Path(spec.clips_dir), Path(spec.uploads_dir)
        self.store = open_job_store(spec.store, spec.lease_s, spec.max_attempts)
        device = spec.device
        if device is None and torch.cuda.is_available():
            device = f"cuda:{spec.index % torch.cuda.device_count()}"
        dtype = getattr(torch, spec.dtype) if spec.dtype else None
        self.t2v = TextToVideoPipeline.from_pretrained(spec.model, device=device, torch_dtype=dtype)
        self.t2v.set_progress_bar_config(disable=True)
        try:
            self.t2v.enable_embed_memo()  # lossless; on by default, as in `render` and the demo
        except ValueError:
            pass  # no Wan-style condition embedder: nothing to memoise
        if spec.preset:
            self.t2v.enable_acceleration(spec.preset)  # before from_pipe and the defaults: both follow it
        _ = self.t2v.loras  # made before from_pipe, so both tasks share one adapter set on the shared transformer
        try:
            self.i2v = ImageToVideoPipeline.from_pipe(self.t2v)
        except ValueError:
            self.i2v = None
        rules = self.t2v.rules
        self.store.set_meta("rules", {"family": rules.family, "temporal_factor": rules.temporal_factor,
                                      "spatial_multiple": rules.spatial_multiple, "max_size": rules.max_size,
                                      "max_frames": rules.max_frames})
        names = ("num_frames", "height", "width", "num_inference_steps", "guidance_scale")
        defaults = {name: self.t2v.default(name) for name in names}
        self.store.set_meta("defaults", {k: v for k, v in defaults.items() if isinstance(v, (int, float))})
        self.store.set_meta(ready_key(spec.owner), os.getpid())
        self._default_cache = self.t2v.step_cache  # the preset's, kept for requests that ask none
        self._cache = "off"

    def run_one(self) -> bool:
        """Claim and run one job; False when the queue was empty."""
        job = self.store.claim(self.spec.index, self.spec.owner)
        if job is None:
            return False
        started = time.perf_counter()
        beat = _Heartbeat(self.store, job)
        try:
            staged = self.render(job, beat)
        except JobStopped:
            self.store.mark_cancelled(job)
        except (WorkerStopping, LeaseLost):
            pass  # the job is someone else's now, or the next start's: nothing more is written
        except Exception as exc:  # noqa: BLE001 - a failing job is recorded; the worker takes the next one
            self.store.fail(job, job_error(exc))
        else:
            try:
                self._publish(job, staged, time.perf_counter() - started)
            except OSError as exc:  # the clip could not be put in place (the folder removed, the disk full)
                staged.unlink(missing_ok=True)
                self.store.fail(job, job_error(exc))
        finally:
            beat.stop()
        return True

    def _publish(self, job: Job, staged: Path, seconds: float) -> None:
        """Rename the staged clip into place and complete the job, only while this attempt still holds it."""
        from metainfer_gen.video.export import durable_replace

        if not self.store.renew(job):  # taken over: the new holder writes the clip
            staged.unlink(missing_ok=True)
            return
        final = self.clips_dir / f"{job.id}.mp4"
        durable_replace(staged, final)
        if not self.store.complete(job, seconds):
            if self.store.mark_cancelled(job):  # cancelled after its last step: the clip goes too
                final.unlink(missing_ok=True)
        for stale in self.clips_dir.glob(f".{job.id}.*"):  # temporaries of killed attempts of this job
            stale.unlink(missing_ok=True)

    def render(self, job: Job, beat: "_Heartbeat | None" = None) -> Path:
        """Render ``job``'s clip into the hidden ``.<id>.a<attempt>.mp4`` of the clips folder (see
        :meth:`_publish`). Raises JobStopped when cancelled mid-way, LeaseLost when taken over."""
        from PIL import Image

        request = VideoRequest.from_dict(job.request)
        pipe = self.i2v if request.image else self.t2v
        if pipe is None:
            raise ValueError("this model does not do image-to-video")
        self._use_cache(request.cache)
        specs = [(request.lora[1], request.lora[2])] if request.lora else []
        if specs or pipe.list_loras():
            pipe.loras.use(specs)
        steps = request.num_inference_steps
        parent = self.spec.parent_pid

        def on_step_end(_pipe, index, _timestep, callback_kwargs):
            percent = min(99, (index + 1) * 100 // steps)
            if parent and os.getppid() != parent:
                os._exit(1)  # the server is gone: the job's lease runs out and another worker re-runs it
            if self.stop is not None and self.stop.is_set():
                raise WorkerStopping(job.id)
            if beat is not None and beat.lost.is_set():
                raise LeaseLost(job.id)
            if not self.store.set_progress(job, percent):
                if self.store.renew(job):
                    raise JobStopped(job.id)  # still ours: a cancel was asked
                raise LeaseLost(job.id)
            return callback_kwargs

        args = (request.prompt,)
        if request.image:
            with Image.open(self.uploads_dir / request.image) as image:
                args = (image.convert("RGB"), request.prompt)
        output = pipe(*args, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                      height=request.height, width=request.width, num_inference_steps=steps,
                      guidance_scale=request.guidance_scale, seed=request.seed, callback_on_step_end=on_step_end)
        return output.save(self.clips_dir / f".{job.id}.a{job.attempt}.mp4", fps=request.fps)

    def _use_cache(self, spec: str) -> None:
        if spec != self._cache:
            self.t2v.disable_step_cache()
            self._cache = "off"
            if spec != "off":
                self.t2v.enable_step_cache(spec)
            elif self._default_cache is not None:
                self.t2v.enable_step_cache(self._default_cache)
            if self.i2v is not None:
                self.i2v.step_cache = self.t2v.step_cache  # same transformer: the hooks are shared
            self._cache = spec


def job_error(exc: BaseException) -> str:
    """What a failed job records (clients read it): the reason, never a path of this machine. A clip that could not
    be written (OSError: disk full, folder gone or read-only) and running out of memory (MemoryError, torch's
    OutOfMemoryError) are named as such."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        import gc

        gc.collect()  # the failed render's tensors: the next job must not start out of memory too
        return f"out of memory rendering this clip ({type(exc).__name__}): ask for fewer frames, a smaller size"
    if isinstance(exc, OSError):
        return f"the clip could not be written: {exc.strerror or type(exc).__name__}"
    return f"{type(exc).__name__}: {exc}"


class _Heartbeat:
    """A thread renewing ``job``'s lease every third of the lease until :meth:`stop`; sets ``lost`` when a renewal
    finds the job no longer this attempt's (or the store unreachable past its retries)."""

    def __init__(self, store, job: Job):
        self.store, self.job = store, job
        self.lost = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{job.id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.store.lease_s / 3):
            try:
                held = self.store.renew(self.job)
            except Exception:  # noqa: BLE001 - an unreachable store: the lease may lapse; stop rendering for it
                held = False
            if not held:
                self.lost.set()
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join(self.store.lease_s)
