"""``metainfer-gen serve --llm none --video DIR`` as a real process, killed with ``kill -9`` while a job renders and
restarted on the same data folder: the finished clips are intact (same bytes), the running job and the queued one
complete once each, and no finished job is rendered again (the store's render counter)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.serve.processes import stop_process
from tests.serve.video_helpers import LONG, SHORT, wait_for

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120


def start_server(model: Path, data_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """(process, base URL without /v1) once the server printed its address; killed if that does not happen."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "metainfer_gen.apps.cli", "serve", "--llm", "none", "--video", str(model),
               "--data-dir", str(data_dir), "--port", "0", "--video-workers", "1", "--video-threads", "1",
               "--video-device", "cpu", "--video-max-size", "64", "--log-level", "warning"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"on (http://\S+)/v1", log.read_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.1)
    proc.kill()
    proc.wait(10)
    raise AssertionError(f"the server did not start (exit {proc.poll()}): {log.read_text()[-3000:]}")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_kill_9_while_a_job_runs_then_restart(tiny_wan_dir, tmp_path):
    import httpx

    from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore

    data, log = tmp_path / "data", tmp_path / "server.log"
    proc, url = start_server(tiny_wan_dir, data, log)
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            done = [http.post("/v1/videos", json={"prompt": f"done {i}", **SHORT, "seed": i}).json()["id"]
                    for i in range(2)]
            assert [wait_for(http, v)["status"] for v in done] == ["completed", "completed"]
            clips = {v: digest(data / "clips" / f"{v}.mp4") for v in done}
            running = http.post("/v1/videos", json={"prompt": "killed", **LONG, "seed": 7}).json()["id"]
            queued = http.post("/v1/videos", json={"prompt": "waiting", **SHORT, "seed": 8}).json()["id"]
            wait_for(http, running, ("in_progress",), min_progress=4)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        stop_process(proc)
    store = SQLiteJobStore(data / "jobs.sqlite3")
    assert store.get(running).status.value == "in_progress" and store.get(queued).status.value == "queued"
    store.close()
    proc, url = start_server(tiny_wan_dir, data, tmp_path / "restarted.log")
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            assert wait_for(http, running)["status"] == "completed"
            assert wait_for(http, queued)["status"] == "completed"
            assert all(http.get(f"/v1/videos/{v}").json()["status"] == "completed" for v in done)
            listed = [v["id"] for v in http.get("/v1/videos", params={"limit": 10}).json()["data"]]
            assert listed == [queued, running, *reversed(done)]  # newest first
    finally:
        stop_process(proc)
    assert {v: digest(data / "clips" / f"{v}.mp4") for v in done} == clips
    store = SQLiteJobStore(data / "jobs.sqlite3")
    try:
        jobs = {v: store.get(v) for v in (*done, running, queued)}
    finally:
        store.close()
    assert {v: j.renders for v, j in jobs.items()} == dict.fromkeys(jobs, 1)  # each finished exactly once
    assert jobs[running].attempt == 2 and jobs[done[0]].attempt == 1  # the killed job ran again, nothing else did
    assert not [p for p in (data / "clips").iterdir() if p.name.startswith(".")]  # no half-written clip left


@pytest.mark.parametrize("flags, words", [(["--llm", "none", "--video", "none"], "nothing to serve"),
                                          (["--lora-dir", "/no/such/folder"], "is not a folder"),
                                          (["--video", "default"], "neither an existing pipeline folder nor a hub"),
                                          (["--video", "/no/such/pipeline"], "does not exist")])
def test_serve_refuses_bad_video_flags_before_loading(flags, words, capsys):
    from metainfer_gen.apps.cli import main

    assert main(["serve", "--port", "0", *flags]) == 2
    assert words in capsys.readouterr().err
