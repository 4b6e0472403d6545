"""The video job store and request checks, without a server: atomic claims across connections, the attempt guard
that keeps a requeued job from being completed by its old claim, cancel semantics, the newest-first cursor, and
how ``seconds``/``fps`` become a frame count. Every store test runs on both backends (SQLite, PostgreSQL)."""

from __future__ import annotations

import threading
import time

import pytest

from metainfer_gen.serve.errors import APIError
from metainfer_gen.serve.video.jobs import JobStatus
from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore
from metainfer_gen.serve.video.request import RequestChecks, parse_video_request
from metainfer_gen.video.rules import VideoRules
from tests.serve.video_helpers import small_limits


def test_claims_from_many_connections_take_each_job_once(opener):
    stores = [opener() for _ in range(4)]
    for i in range(40):
        stores[0].add(f"job{i}", {"n": i})
    taken: list[list[str]] = [[] for _ in stores]

    def drain(index: int) -> None:
        for _ in range(100):  # bounded: more rounds than jobs
            job = stores[index].claim(index)
            if job is None:
                return
            taken[index].append(job.id)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ids = [j for part in taken for j in part]
    assert sorted(ids) == sorted(f"job{i}" for i in range(40)) and len(set(ids)) == 40


def test_a_requeued_job_cannot_be_completed_by_its_old_claim(opener):
    store = opener(lease_s=0.2)
    store.add("a", {})
    first = store.claim(0)
    assert store.set_progress(first, 40)
    time.sleep(0.3)  # no heartbeat: the lease runs out
    assert store.requeue_expired() == 1
    assert store.get("a").status is JobStatus.QUEUED and store.get("a").progress == 0
    second = store.claim(1)
    assert second.attempt == first.attempt + 1
    assert not store.complete(first, 1.0) and not store.set_progress(first, 50)
    assert store.complete(second, 2.0)
    job = store.get("a")
    assert (job.status, job.renders, job.progress, job.render_seconds) == (JobStatus.COMPLETED, 1, 100, 2.0)
    assert store.complete(second, 2.0) and store.get("a").renders == 1  # a retried completion is never counted twice


def test_cancel_queued_running_and_finished(opener):
    store = opener()
    for name in ("queued", "running", "done"):
        store.add(name, {})
    assert store.cancel("queued").status is JobStatus.CANCELLED
    running = store.claim(0)
    assert running.id == "running"
    assert store.cancel("running").cancel_requested and store.get("running").status is JobStatus.IN_PROGRESS
    assert not store.set_progress(running, 10)  # the worker's next step sees the cancel
    assert store.mark_cancelled(running)
    done = store.claim(0)
    assert store.complete(done, 0.5)
    store.add("late", {})
    late = store.claim(0)  # cancelled after its last step, while the clip was being written
    store.cancel("late")
    assert not store.complete(late, 0.5) and store.mark_cancelled(late) and store.get("late").renders == 0
    assert not store.delete("nope") and store.delete("done") and store.get("done") is None
    assert store.cancel("nope") is None
    assert store.counts()[JobStatus.CANCELLED] == 3


def test_list_is_newest_first_with_an_after_cursor(opener):
    store = opener()
    for i in range(5):
        store.add(f"j{i}", {})
    assert [j.id for j in store.list(3)] == ["j4", "j3", "j2"]
    assert [j.id for j in store.list(3, after="j2")] == ["j1", "j0"]
    with pytest.raises(KeyError):
        store.list(3, after="missing")


def checks() -> RequestChecks:
    return RequestChecks(small_limits(), VideoRules("WanPipeline", 4, 16), {"num_inference_steps": 20,
                                                                            "guidance_scale": 4.0, "fps": 8.0},
                         "demo", ("off", "auto"), loading=False)


@pytest.mark.parametrize("seconds, fps, frames", [("2", None, 17), (1, 4, 5), ("0.1", None, 1), (4, "8", 33)])
def test_seconds_at_fps_give_the_nearest_valid_frame_count(seconds, fps, frames):
    body = {"prompt": "p", "seconds": seconds, "size": "32x48", **({"fps": fps} if fps else {})}
    request = parse_video_request(body, checks())
    assert (request.num_frames, request.width, request.height) == (frames, 32, 48)
    assert request.seconds == f"{frames / float(fps or 8):g}" and request.seed >= 0  # a seed is drawn and kept


@pytest.mark.parametrize("body, param", [({"prompt": "p", "seconds": "2"}, "height"),
                                         ({"prompt": "p", "seconds": "2", "size": "32x32", "width": "48"}, "width"),
                                         ({"prompt": "p", "num_frames": 9, "size": "32"}, "size"),
                                         ({"prompt": "p", "num_frames": 9, "size": "32x32", "fps": "nan"}, "fps"),
                                         ({"prompt": "p", "num_frames": 9, "size": "32x32", "lora": "a"}, "lora")])
def test_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse_video_request(body, checks())
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_too_many_seconds_are_refused_in_seconds():
    with pytest.raises(APIError) as info:  # 999 s at 8 fps: 7,993 frames, past the 33 the limits allow
        parse_video_request({"prompt": "p", "seconds": "999", "size": "32x32"}, checks())
    assert info.value.status == 400 and info.value.param == "seconds"
    assert info.value.message.startswith("seconds=999 is 7993 frames at 8 fps") and "at most 4 seconds" in \
        info.value.message, info.value.message
    with pytest.raises(APIError) as info:  # frames asked as frames stay frames
        parse_video_request({"prompt": "p", "num_frames": 37, "size": "32x32"}, checks())
    assert info.value.param == "num_frames"


def test_one_server_per_data_folder(tmp_path, tiny_wan_dir):
    """A second service on a folder another one holds is refused before it re-queues that one's running jobs; the
    folder is free again once the first closes."""
    from metainfer_gen.serve.video.service import DataDirInUse, VideoServeConfig, VideoService

    config = VideoServeConfig(data_dir=tmp_path / "data", limits=small_limits(), model=tiny_wan_dir, num_workers=1)
    first = VideoService(config)  # no workers started: the folder, its lock and the store
    try:
        with pytest.raises(DataDirInUse, match="in use by another server"):
            VideoService(config)
    finally:
        first.close()
    VideoService(config).close()  # released: a restart on the folder opens it


def test_a_dead_workers_readiness_is_forgotten_alone(opener):
    store = opener()
    store.set_meta("ready:0", 101)
    store.set_meta("ready:1", 102)
    store.set_meta("ready:1", 103)
    store.delete_meta("ready:0")
    assert store.get_meta("ready:0") is None and store.get_meta("ready:1") == 103
