"""One video worker process: load the model once, then take jobs from the store until told to stop.

The server starts :func:`worker_main` in fresh (``spawn``) processes, one per GPU, or on the CPU with the cores
split between them. Each job runs with a diffusers ``callback_on_step_end`` that records the progress and reads
the job's cancel flag in the same SQLite statement; a cancel (or the server's death) stops the job at the next
denoising step. A job that raises records its error and the worker takes the next one. The clip is written by
the project's exporter (H.264 yuv420p, temporary file renamed into place) before the job is marked completed,
so a completed job always has its whole clip and a kill in between only re-runs the job.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from metainfer_gen.serve.video.jobs import STORE_NAME, Job, JobStore
from metainfer_gen.serve.video.request import VideoRequest

POLL_S = 0.05  # an idle worker looks for a job this often (one indexed SELECT)
CLIPS = "clips"
UPLOADS = "uploads"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process needs (picklable: it crosses to a spawned process).

    Attributes:
        index: the worker's number (0-based; the ``worker`` column of its jobs). data_dir: the store's folder.
        model: pipeline folder or hub id (None: the embedded model). device: "cpu", "cuda", "cuda:N" or None
            (GPU ``index`` of the visible ones when CUDA is available, else the CPU). dtype: torch dtype name or
            None (the pipeline's default). num_threads: CPU threads of this process (None: torch's default).
        parent_pid: the server's pid; the worker exits when its parent is gone.
    """

    index: int
    data_dir: str
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    num_threads: int | None = None
    parent_pid: int = 0


class JobStopped(Exception):
    """Raised from the step callback: the job was cancelled."""


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
    if spec.num_threads:
        os.environ["OMP_NUM_THREADS"] = str(spec.num_threads)
    worker = VideoWorker(spec, stop)
    try:
        while not stop.is_set() and os.getppid() == spec.parent_pid:
            if not worker.run_one():
                time.sleep(POLL_S)
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
        self.data_dir = Path(spec.data_dir)
        self.store = JobStore(self.data_dir / STORE_NAME)
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
        self.store.set_meta(f"ready:{spec.index}", os.getpid())
        self._cache = "off"

    def run_one(self) -> bool:
        """Claim and run one job; False when the queue was empty."""
        job = self.store.claim(self.spec.index)
        if job is None:
            return False
        started = time.perf_counter()
        try:
            path = self.render(job)
        except JobStopped:
            self.store.mark_cancelled(job)
        except WorkerStopping:
            pass
        except Exception as exc:  # noqa: BLE001 - a failing job is recorded; the worker takes the next one
            self.store.fail(job, f"{type(exc).__name__}: {exc}")
        else:
            if not self.store.complete(job, time.perf_counter() - started):
                if self.store.mark_cancelled(job):  # cancelled after its last step: the clip goes too
                    path.unlink(missing_ok=True)
        return True

    def render(self, job: Job) -> Path:
        """Render ``job``'s clip into ``clips/<id>.mp4``. Raises JobStopped when cancelled mid-way."""
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
                os._exit(1)  # the server is gone: the next one re-runs this job
            if self.stop is not None and self.stop.is_set():
                raise WorkerStopping(job.id)
            if not self.store.set_progress(job, percent):
                raise JobStopped(job.id)
            return callback_kwargs

        args = (request.prompt,)
        if request.image:
            with Image.open(self.data_dir / UPLOADS / request.image) as image:
                args = (image.convert("RGB"), request.prompt)
        output = pipe(*args, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                      height=request.height, width=request.width, num_inference_steps=steps,
                      guidance_scale=request.guidance_scale, seed=request.seed, callback_on_step_end=on_step_end)
        return output.save(self.data_dir / CLIPS / f"{job.id}.mp4", fps=request.fps)

    def _use_cache(self, spec: str) -> None:
        if spec != self._cache:
            self.t2v.disable_step_cache()
            self._cache = "off"
            if spec != "off":
                self.t2v.enable_step_cache(spec)
            if self.i2v is not None:
                self.i2v.step_cache = self.t2v.step_cache  # same transformer: the hooks are shared
            self._cache = spec
