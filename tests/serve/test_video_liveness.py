"""Failed writes and dead workers under a live video server (tiny Wan model, one worker process of one thread, on a
free loopback port): a clip that cannot be written (a full disk: a small tmpfs; a read-only folder where mounting
is not allowed) fails its job with the reason and leaves no file; a job that kills its worker is re-run until
``max_attempts``, then fails; the supervisor outlives a store error; ``/health`` says 503 once the supervisor is
gone; and a worker pool's restart budget recovers over time."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time

import httpx
import pytest

from tests.serve.video_helpers import LONG, SHORT, small_limits, wait_for
from tests.video.mp4_inspect import ffmpeg_stream_info

MAX_ATTEMPTS = 2
TMPFS_BYTES = 4 << 20
BIG = {**LONG, "num_inference_steps": 2}  # 33 frames of 64 x 64: tens of KB, quick to render


def _mount_tmpfs(folder) -> bool:
    """A small tmpfs on ``folder`` (root only); False where mounting is not allowed."""
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def live(tiny_wan_dir, tmp_path_factory):
    from metainfer_gen.serve.server import LLMServer, ServeConfig
    from metainfer_gen.serve.video.service import VideoServeConfig

    clips = tmp_path_factory.mktemp("clips")
    mounted = _mount_tmpfs(clips)
    video = VideoServeConfig(data_dir=tmp_path_factory.mktemp("liveness"), limits=small_limits(),
                             model=tiny_wan_dir, num_workers=1, num_threads=1, device="cpu", clips_dir=clips,
                             max_attempts=MAX_ATTEMPTS)
    server = LLMServer.start(ServeConfig(port=0, with_llm=False, video=video))
    try:
        server.video.wait_ready(120)
        with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=60) as http:
            yield server, http, clips, mounted
    finally:
        server.close()
        if mounted:
            subprocess.run(["umount", "-l", str(clips)], check=False)


def _submit(http, prompt: str, fields=SHORT) -> str:
    answer = http.post("/v1/videos", json={"prompt": prompt, **fields, "seed": 3})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def _new_worker(service, old, timeout_s: float = 120):
    """The worker process that replaced ``old`` once it has loaded the model (bounded)."""
    deadline = time.monotonic() + timeout_s
    while service.pool.process(0) is old or not service.pool.process(0).is_alive() or not service.num_ready_workers:
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.1)
    return service.pool.process(0)


def test_a_clip_that_cannot_be_written_fails_its_job_and_leaves_no_file(live, tmp_path):
    server, http, clips, mounted = live
    filler = clips / "filler"
    if mounted:  # a full disk: all but 8 KB of the tmpfs taken
        free = os.statvfs(clips).f_bavail * os.statvfs(clips).f_frsize
        filler.write_bytes(b"\0" * max(0, free - 8192))
    else:  # a read-only folder
        clips.chmod(0o555)
    try:
        video_id = _submit(http, "onto a full disk", BIG)
        failed = wait_for(http, video_id)
    finally:
        filler.unlink(missing_ok=True)
        clips.chmod(0o755)
    assert failed["status"] == "failed", failed
    message = failed["error"]["message"]
    assert "could not be written" in message and str(clips) not in message
    assert ("No space left" in message or "disk full" in message) if mounted else "Permission denied" in message
    assert sorted(p.name for p in clips.iterdir()) == ["uploads"]  # no clip, no hidden temporary
    assert http.get(f"/v1/videos/{video_id}/content").status_code == 404
    done = wait_for(http, _submit(http, "with room again", BIG))  # the worker goes on
    assert done["status"] == "completed"
    http.get(f"/v1/videos/{done['id']}/content").raise_for_status()
    path = tmp_path / "clip.mp4"
    path.write_bytes(http.get(f"/v1/videos/{done['id']}/content").content)
    assert ffmpeg_stream_info(path)["frames"] == 33  # completed means a whole, decodable clip


def test_a_job_that_kills_its_worker_is_re_run_then_fails_at_max_attempts(live):
    server, http, _, _ = live
    service = server.video
    video_id = _submit(http, "kills its worker", LONG)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        deadline = time.monotonic() + 120
        while (job := http.get(f"/v1/videos/{video_id}").json())["attempts"] < attempt or job["progress"] < 2:
            assert job["status"] in ("queued", "in_progress") and time.monotonic() < deadline, job
            time.sleep(0.05)
        old = service.pool.process(0)
        os.kill(old.pid, signal.SIGKILL)  # what a segfault or the kernel's OOM killer does
        if attempt < MAX_ATTEMPTS:
            _new_worker(service, old)
    failed = wait_for(http, video_id, timeout_s=30)
    assert failed["status"] == "failed" and failed["attempts"] == MAX_ATTEMPTS
    assert failed["error"]["message"] == (f"gave up after {MAX_ATTEMPTS} attempts: the worker process died running "
                                          "it (last exit code -9)")
    _new_worker(service, old)
    assert wait_for(http, _submit(http, "after the poison job"))["status"] == "completed"


def test_the_supervisor_outlives_a_store_error(live, monkeypatch):
    server, http, _, _ = live
    service = server.video
    real, calls = service.store.delete_meta, []

    def failing_once(key):
        calls.append(key)
        if len(calls) == 1:
            raise sqlite3.OperationalError("disk I/O error")
        return real(key)

    monkeypatch.setattr(service.store, "delete_meta", failing_once)
    old = service.pool.process(0)
    os.kill(old.pid, signal.SIGKILL)
    _new_worker(service, old)
    assert len(calls) >= 2  # failed once, retried at the next check
    assert http.get("/health").status_code == 200
    assert wait_for(http, _submit(http, "after a store error"))["status"] == "completed"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the ending we cause
def test_health_is_503_once_the_supervisor_is_gone(live, monkeypatch):
    server, http, _, _ = live
    assert http.get("/health").status_code == 200

    def crash():
        raise SystemExit("the supervisor thread ends")  # not an Exception: nothing catches it

    monkeypatch.setattr(server.video.pool, "_check_workers", crash)
    deadline = time.monotonic() + 10
    while (health := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health.status_code == 503 and "supervisor has stopped" in health.json()["error"]["message"]


def _exit_at_once(spec, stop) -> None:
    """A worker entry point that dies as soon as it starts (a model that cannot load)."""
    os._exit(3)


def test_the_restart_budget_recovers_over_time(tmp_path):
    from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore
    from metainfer_gen.serve.video.worker import WorkerSpec
    from metainfer_gen.serve.video.worker_pool import WorkerPool

    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    window_s = 4.0
    pool = WorkerPool(lambda i: WorkerSpec(i, str(tmp_path / "jobs.sqlite3"), str(tmp_path), str(tmp_path), f"t/{i}"),
                      1, store, max_restarts=2, restart_window_s=window_s, target=_exit_at_once).start()
    seen: dict[int, float] = {}  # pid -> when first seen
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 4 and time.monotonic() < deadline:
            seen.setdefault(pool.process(0).pid, time.monotonic())
            time.sleep(0.02)
    finally:
        pool.close()
        store.close()
    assert len(seen) == 4, f"{len(seen)} processes: the budget did not recover"
    first, second, third, fourth = sorted(seen.values())
    assert fourth - second >= window_s - 1.0  # two restarts spent the budget: the third waited for the window


class OutOfMemoryOnce:
    """A pipeline whose first call raises ``error`` (as a render past the memory would); the others render."""

    def __init__(self, pipe, error: BaseException):
        self.pipe, self.error = pipe, error

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    def __call__(self, *args, **kwargs):
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self.pipe(*args, **kwargs)


@pytest.fixture
def in_process(tiny_wan_dir, tmp_path):
    """A :class:`VideoWorker` in this process over its own store in ``tmp_path`` (clips there too), with two jobs
    queued: ``video_first`` then ``video_after``; yields (worker, store)."""
    from metainfer_gen.serve.video.request import VideoRequest
    from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore
    from metainfer_gen.serve.video.worker import VideoWorker, WorkerSpec

    (tmp_path / "uploads").mkdir()
    spec = WorkerSpec(0, str(tmp_path / "jobs.sqlite3"), str(tmp_path), str(tmp_path / "uploads"), "test/0",
                      str(tiny_wan_dir), "cpu", num_threads=1)
    worker = VideoWorker(spec)
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    for name in ("video_first", "video_after"):
        store.add(name, VideoRequest(name, None, 5, 32, 32, 2, 1.0, 0, 8.0).to_dict())
    yield worker, store
    store.close()
    worker.store.close()


@pytest.mark.parametrize("error", [MemoryError(), "torch"])
def test_running_out_of_memory_fails_that_job_with_the_error(in_process, tmp_path, error):
    import torch

    worker, store = in_process
    raised = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB") if error == "torch" else error
    worker.t2v = OutOfMemoryOnce(worker.t2v, raised)
    assert worker.run_one() and worker.run_one()
    failed, after = store.get("video_first"), store.get("video_after")
    assert failed.status.value == "failed" and failed.error.startswith("out of memory rendering this clip (")
    assert type(raised).__name__ in failed.error
    assert after.status.value == "completed" and (tmp_path / "video_after.mp4").is_file()  # the worker went on


def test_a_clip_removed_under_the_worker_fails_its_job_and_the_worker_goes_on(in_process, tmp_path):
    worker, store = in_process
    render = worker.render

    def removed_before_publishing(job, beat=None):
        staged = render(job, beat)
        if job.id == "video_first":
            staged.unlink()  # what a clean-up script or a full-disk handler does under the server
        return staged

    worker.render = removed_before_publishing
    assert worker.run_one() and worker.run_one()
    failed, after = store.get("video_first"), store.get("video_after")
    assert failed.status.value == "failed" and failed.error == ("the clip could not be written: No such file or "
                                                                "directory")
    assert not (tmp_path / "video_first.mp4").exists()
    assert after.status.value == "completed" and (tmp_path / "video_after.mp4").is_file()
