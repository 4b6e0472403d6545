"""The job store failing under a live server (LLM and ``/v1/videos`` on one free loopback port, API-only: no
worker renders, so the queue holds still): a store locked by another process holds up the video calls only,
never ``/health`` or an LLM request, and past the busy timeout a write is a 503 that wrote nothing; rows the code cannot
read never break ``GET /v1/videos``; a full queue (``--max-queued-videos``) answers 429 with ``Retry-After``; a job that
took its server down ``max_attempts`` times fails at the next start instead of looping; a corrupt store file stops
start-up, naming the file and the way out."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.conftest import MODEL
from tests.serve.video_helpers import SHORT, small_limits

MAX_QUEUED_VIDEOS = 3
LOCK_S = 4.0
# Holds SQLite's write lock on argv[1] for argv[2] seconds, as another process (a backup, a second tool) would.
HOLD_LOCK = ("import sqlite3, sys, time\n"
             "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
             "db.execute('BEGIN IMMEDIATE')\n"
             "print('locked', flush=True)\n"
             "time.sleep(float(sys.argv[2]))\n"
             "db.execute('COMMIT')\n")


def start_api_only(data_dir, model, llm: bool = True, **video_options):
    from metainfer_gen.serve.server import LLMServer, ServeConfig
    from metainfer_gen.serve.video.service import VideoServeConfig

    video = VideoServeConfig(data_dir=data_dir, limits=small_limits(), model=model, num_workers=0,
                             **video_options)
    return LLMServer.start(ServeConfig(port=0, with_llm=llm, video=video, engine={"num_kv_blocks": 64},
                                       admission={"max_queued_videos": MAX_QUEUED_VIDEOS}))


@pytest.fixture(scope="module")
def api(tiny_wan_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("store_failures")
    server = start_api_only(data, tiny_wan_dir)
    with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=60) as http:
        yield server, http, data
    server.close()


def submit(http, prompt: str) -> httpx.Response:
    return http.post("/v1/videos", json={"prompt": prompt, **SHORT, "seed": 1})


def cancel_all_queued(http) -> None:
    for video in http.get("/v1/videos", params={"limit": 100}).json()["data"]:
        if video["status"] == "queued":
            http.delete(f"/v1/videos/{video['id']}")


def test_a_store_locked_by_another_process_holds_up_no_one_else(api):
    server, http, data = api
    base = server.base_url.removesuffix("/v1")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(data / "jobs.sqlite3"), str(LOCK_S)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        locked_at = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            queued = pool.submit(lambda: httpx.post(f"{base}/v1/videos", timeout=60,
                                                    json={"prompt": "behind the lock", **SHORT, "seed": 2}))
            time.sleep(0.3)  # the submit now waits for the lock, holding the store's connection
            listed = pool.submit(lambda: httpx.get(f"{base}/v1/videos", timeout=60))
            time.sleep(0.3)
            slowest = 0.0
            for _ in range(5):
                started = time.monotonic()
                assert httpx.get(f"{base}/health", timeout=10).status_code == 200
                slowest = max(slowest, time.monotonic() - started)
            started = time.monotonic()
            answer = httpx.post(f"{base}/v1/completions", timeout=30, json={"model": MODEL, "prompt": "Hi",
                                                                            "max_tokens": 4, "temperature": 0})
            llm_s = time.monotonic() - started
            assert time.monotonic() - locked_at < LOCK_S, "the checks ran after the lock was released"
            assert answer.status_code == 200 and slowest < 1.0 and llm_s < 2.0, (slowest, llm_s)
            assert queued.result(60).status_code == 200 and listed.result(60).status_code == 200
        assert time.monotonic() - locked_at >= LOCK_S - 0.5  # the submit waited for the lock, then went through
        assert http.get(f"/v1/videos/{queued.result().json()['id']}").json()["status"] == "queued"
    finally:
        holder.kill()
        holder.wait(10)
        cancel_all_queued(http)


def test_a_write_that_waits_past_the_busy_timeout_is_a_503_that_loses_nothing(tiny_wan_dir, tmp_path):
    server = start_api_only(tmp_path, tiny_wan_dir, llm=False, store_busy_timeout_s=0.5)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / "jobs.sqlite3"), "3"],
                              stdout=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=30) as http:
            assert holder.stdout.readline().strip() == "locked"
            busy = submit(http, "behind a long lock")
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", busy.text
            error = busy.json()["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", "store_busy")
            assert "locked by another process" in error["message"]
            assert http.get("/health").status_code == 200
            holder.wait(30)
            assert http.get("/v1/videos").json()["data"] == []  # the refused job was not written
            assert submit(http, "once the lock is gone").status_code == 200
    finally:
        holder.kill()
        holder.wait(10)
        server.close()


def test_rows_the_code_cannot_read_never_break_the_list(api):
    server, http, data = api
    good = submit(http, "a readable job").json()["id"]
    with sqlite3.connect(data / "jobs.sqlite3", timeout=10) as db:
        seq = db.execute("SELECT MAX(seq) FROM jobs").fetchone()[0]
        db.executemany("INSERT INTO jobs (id, seq, created_at, status, request) VALUES (?, ?, ?, ?, ?)", [
            ("video_badjson", seq + 1, 1, "completed", '{"prompt": "cut sho'),
            ("video_badstatus", seq + 2, 1, "exploded", "{}"),
            ("video_badrequest", seq + 3, 1, "completed", '{"no_such_field": 1}'),
            ("video_notobject", seq + 4, 1, "failed", "[1, 2]")])
    answer = http.get("/v1/videos", params={"limit": 10})
    assert answer.status_code == 200, answer.text
    listed = {v["id"]: v for v in answer.json()["data"]}
    assert listed[good]["status"] == "queued" and listed[good]["prompt"] == "a readable job"
    for bad in ("video_badjson", "video_badstatus", "video_badrequest", "video_notobject"):
        assert listed[bad]["status"] == "failed" and "cannot be read" in listed[bad]["error"]["message"], bad
        assert listed[bad]["prompt"] is None
        assert http.get(f"/v1/videos/{bad}").json()["status"] == "failed"
        deleted = http.delete(f"/v1/videos/{bad}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
        assert http.get(f"/v1/videos/{bad}").status_code == 404
    cancel_all_queued(http)


def test_a_full_video_queue_answers_429_and_keeps_what_it_admitted(api):
    server, http, data = api
    cancel_all_queued(http)
    admitted = [submit(http, f"queued {i}") for i in range(MAX_QUEUED_VIDEOS)]
    assert [r.status_code for r in admitted] == [200] * MAX_QUEUED_VIDEOS
    refused = submit(http, "one too many")
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "queue_full") and "--max-queued-videos 3" in error["message"]
    statuses = {v["id"]: v["status"] for v in http.get("/v1/videos", params={"limit": 100}).json()["data"]}
    assert all(statuses[r.json()["id"]] == "queued" for r in admitted)  # nothing admitted was lost
    assert "one too many" not in [v["prompt"] for v in http.get("/v1/videos").json()["data"]]
    http.delete(f"/v1/videos/{admitted[0].json()['id']}")  # room again: admitted
    assert submit(http, "after a cancel").status_code == 200
    cancel_all_queued(http)


def test_a_job_that_took_its_server_down_max_attempts_times_fails_at_the_next_start(tiny_wan_dir, tmp_path):
    from metainfer_gen.serve.video.request import VideoRequest
    from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore

    def request(prompt: str) -> dict:
        return VideoRequest(prompt, None, 5, 32, 32, 2, 1.0, 0, 8.0).to_dict()

    store = SQLiteJobStore(tmp_path / "jobs.sqlite3", max_attempts=2)
    store.add("video_poison", request("kills its server"))
    store.add("video_once", request("interrupted once"))
    assert store.claim(0).id == "video_poison"
    store.requeue_interrupted()  # the first crash of its server: back in the queue
    assert [store.claim(0).id, store.claim(1).id] == ["video_poison", "video_once"]  # poison's 2nd claim
    store.close()
    server = start_api_only(tmp_path, tiny_wan_dir, llm=False, max_attempts=2)
    try:
        with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=30) as http:
            poison = http.get("/v1/videos/video_poison").json()
            assert poison["status"] == "failed" and poison["attempts"] == 2
            assert poison["error"]["message"].startswith("gave up after 2 attempts")
            assert http.get("/v1/videos/video_once").json()["status"] == "queued"  # one attempt left: re-run
    finally:
        server.close()


def test_a_corrupt_store_file_stops_start_up_naming_it_and_the_way_out(tiny_wan_dir, tmp_path, capsys):
    from metainfer_gen.apps.cli import main

    store = tmp_path / "jobs.sqlite3"
    store.write_bytes(b"this is not an SQLite database, it was overwritten " * 100)
    assert main(["serve", "--llm", "none", "--video", str(tiny_wan_dir), "--data-dir", str(tmp_path),
                 "--port", "0", "--video-workers", "0"]) == 2
    err = capsys.readouterr().err
    assert str(store) in err and f"mv {store} {store}.corrupt" in err and "backup" in err
    assert store.read_bytes().startswith(b"this is not")  # nothing was changed
