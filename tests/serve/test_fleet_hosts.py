"""Two hosts made as network namespaces share one PostgreSQL job store (reached over their veth links) and one
clips folder; each runs its own ``metainfer-gen serve`` with one video worker (``tests/serve/fleet_harness.py``).

Shown: jobs submitted through both APIs complete exactly once and either host answers for every job; a cancel sent
to one host stops the job the other renders; PostgreSQL restarted mid-run loses and repeats nothing; a batch
``render --job-store`` interrupted with Ctrl-C and rerun renders each line once; ``kill -9`` of the rendering host
hands its job to the other host once the lease expires, and the killed attempt wrote nothing.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from tests.serve.netns import can_make_namespaces
from tests.serve.postgres_cluster import postgres_bindir
from tests.serve.video_helpers import LONG, SHORT, wait_for

pytest.importorskip("psycopg_pool", reason="the fleet tests need the fleet extra: pip install 'metainfer-gen[fleet]'")
if can_make_namespaces() is not None:
    pytest.skip(can_make_namespaces(), allow_module_level=True)
if postgres_bindir() is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true and no PostgreSQL binaries: install Debian's postgresql (.ci/run does)")
    pytest.skip("no PostgreSQL binaries (apt-get install postgresql)", allow_module_level=True)

LEASE_S = 3.0


@pytest.fixture(scope="module")
def fleet(tiny_wan_dir, tmp_path_factory):
    from tests.serve.fleet_harness import Fleet

    made = Fleet(tiny_wan_dir, tmp_path_factory.mktemp("fleet"), num_hosts=2, lease_s=LEASE_S)
    try:
        made.start(0)
        made.start(1)
        made.wait_workers_ready()
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def store(fleet):
    from metainfer_gen.serve.video.stores import open_job_store

    opened = open_job_store(fleet.store_url)
    yield opened
    opened.close()


@pytest.fixture
def apis(fleet):
    import httpx

    clients = [httpx.Client(base_url=fleet.url(i), timeout=30) for i in range(2)]
    yield clients
    for client in clients:
        client.close()


def submit(api, prompt: str, settings: dict, seed: int) -> str:
    answer = api.post("/v1/videos", json={"prompt": prompt, **settings, "seed": seed})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def test_16_jobs_through_both_hosts_complete_once_and_either_host_answers(fleet, store, apis):
    ids = [submit(apis[i % 2], f"fleet job {i}", SHORT, i) for i in range(16)]
    assert all(wait_for(apis[(i + 1) % 2], v)["status"] == "completed" for i, v in enumerate(ids))
    jobs = [store.get(v) for v in ids]
    assert [j.renders for j in jobs] == [1] * 16  # each rendered exactly once, fleet-wide
    by_host = [sum(fleet.host_of(j.owner) == h for j in jobs) for h in range(2)]
    print(f"renders per host: {by_host}")
    assert min(by_host) >= 1 and sum(by_host) == 16
    digests = {v: hashlib.sha256((fleet.clips / f"{v}.mp4").read_bytes()).hexdigest() for v in ids}
    for api in apis:  # either host answers status, list and content for every job
        assert all(api.get(f"/v1/videos/{v}").json()["status"] == "completed" for v in ids)
        listed = {v["id"] for v in api.get("/v1/videos", params={"limit": 100}).json()["data"]}
        assert set(ids) <= listed
        assert {v: hashlib.sha256(api.get(f"/v1/videos/{v}/content").content).hexdigest() for v in ids} == digests


def test_a_cancel_sent_to_one_host_stops_the_job_the_other_renders(fleet, store, apis):
    video_id = submit(apis[0], "cancelled across hosts", LONG, 21)
    seen = wait_for(apis[0], video_id, ("in_progress",), min_progress=4)
    renderer = fleet.host_of(store.get(video_id).owner)
    other = apis[1 - renderer]
    sent = time.monotonic()
    answer = other.delete(f"/v1/videos/{video_id}").json()
    assert answer["cancel_requested"] and answer["status"] == "in_progress"
    final = wait_for(other, video_id, timeout_s=30)
    took = time.monotonic() - sent
    job = store.get(video_id)
    print(f"cancel on host {1 - renderer} of a job on host {renderer}: progress {seen['progress']}% when seen, "
          f"stopped at {job.progress}% after {took:.2f} s")
    assert final["status"] == "cancelled" and job.renders == 0 and job.progress < 100
    assert not (fleet.clips / f"{video_id}.mp4").exists()


def test_postgresql_restarted_mid_run_loses_and_repeats_nothing(fleet, store, apis):
    ids = [submit(apis[i % 2], f"through a restart {i}", SHORT if i % 3 else {**SHORT, "num_inference_steps": 20},
                  30 + i) for i in range(8)]
    wait_for(apis[0], ids[0], ("in_progress", "completed"))
    fleet.postgres.restart()  # fast shutdown: every connection of both hosts is cut
    assert [wait_for(apis[i % 2], v)["status"] for i, v in enumerate(ids)] == ["completed"] * 8
    assert [store.get(v).renders for v in ids] == [1] * 8


# The Ctrl-C must land mid-batch. Warm fleet workers render these tiny clips at about 10 a second, and under the whole
# suite's load the render command collected all of them before the test saw two in its manifest. So both hosts are
# frozen (SIGSTOP) while the command queues the batch, holding no job then, and only host 0 renders until the Ctrl-C:
# the batch takes one host many seconds, the test only has to see two clips collected. Nothing leased is frozen.
LINES = 96


def test_render_through_the_fleet_interrupted_and_rerun_renders_each_line_once(fleet, store, tiny_wan_dir,
                                                                              tmp_path):
    import json
    import signal
    import subprocess
    import sys

    from metainfer_gen.apps.render_fleet import ID_PREFIX
    from tests.serve.fleet_harness import ROOT

    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"batch line {i}", "num_frames": 9, "height": 32, "width": 32, "num_inference_steps": 40,
              "guidance_scale": 1.0} for i in range(LINES)]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out, manifest = tmp_path / "out", tmp_path / "out" / "manifest.jsonl"
    command = [sys.executable, "-m", "metainfer_gen.apps.cli", "render", "--prompts", str(prompts), "--out-dir",
               str(out), "--model", str(tiny_wan_dir), "--job-store", fleet.store_url, "--clips-dir",
               str(fleet.clips), "--seed", "100"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))

    def ok_lines() -> int:
        text = manifest.read_text() if manifest.exists() else ""
        return sum(json.loads(line)["status"] == "ok" for line in text.splitlines() if line.strip())

    def queued_in_store() -> int:
        return sum(j.id.startswith(ID_PREFIX) for j in store.list(200))

    def within(seconds: float, predicate) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not predicate() and first.poll() is None:
            time.sleep(0.05)
        return predicate() or first.poll() is not None

    for i in range(2):
        fleet.pause(i)
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = ""
    try:
        try:
            assert within(120.0, lambda: queued_in_store() >= LINES), "the batch was not queued in 120 s"
            fleet.resume(0)
            if within(120.0, lambda: ok_lines() >= 2):
                first.send_signal(signal.SIGINT)  # Ctrl-C, while host 1 is frozen and host 0 renders
        finally:
            for i in range(2):  # before waiting: a frozen worker may hold a row lock the command needs
                fleet.resume(i)
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    collected = ok_lines()
    assert first.returncode == 130 and "stay queued" in err and 2 <= collected < LINES, (first.returncode, err)
    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert (summary["skipped"], summary["rendered"], summary["failed"]) == (collected, LINES - collected, 0)
    records = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    assert [r["status"] for r in records] == ["ok"] * LINES and all((out / r["path"]).is_file() for r in records)
    batch = [j for j in store.list(200) if j.id.startswith(ID_PREFIX)]
    print(f"render interrupted after {collected} of {LINES} clips; the rerun collected {summary['rendered']}")
    assert len(batch) == LINES and [j.renders for j in batch] == [1] * LINES  # nothing submitted or rendered twice


def test_kill_9_of_the_rendering_host_hands_its_job_over_after_the_lease(fleet, store, apis):
    done = [submit(apis[i], f"finished before the kill {i}", SHORT, 40 + i) for i in range(2)]
    assert [wait_for(apis[0], v)["status"] for v in done] == ["completed", "completed"]
    before = {v: hashlib.sha256((fleet.clips / f"{v}.mp4").read_bytes()).hexdigest() for v in done}
    video_id = submit(apis[0], "killed mid-render", LONG, 50)
    wait_for(apis[0], video_id, ("in_progress",), min_progress=4)
    first = store.get(video_id)
    victim = fleet.host_of(first.owner)
    survivor = 1 - victim
    killed = fleet.kill(victim)
    killed_at = time.monotonic()
    taken = None
    for _ in range(600):  # bounded: 60 s at 0.1 s
        job = store.get(video_id)
        if job.attempt > first.attempt:
            taken = time.monotonic() - killed_at
            break
        time.sleep(0.1)
    assert taken is not None, "no other host took the job over"
    final = wait_for(apis[survivor], video_id)
    job = store.get(video_id)
    print(f"kill -9 of host {victim} ({len(killed)} processes) at {first.progress}%: host {survivor} claimed the "
          f"job {taken:.1f} s later (lease {LEASE_S:g} s), attempt {job.attempt}")
    assert final["status"] == "completed" and job.renders == 1 and job.attempt == first.attempt + 1
    assert fleet.host_of(job.owner) == survivor and taken >= LEASE_S * 0.5
    assert not list(fleet.clips.glob(f".{video_id}.*"))  # the killed attempt left nothing behind
    assert {v: hashlib.sha256((fleet.clips / f"{v}.mp4").read_bytes()).hexdigest() for v in done} == before
    fleet.start(victim)  # the host comes back and takes work again
    fleet.wait_workers_ready()
    again = submit(apis[victim], "after the comeback", SHORT, 60)
    assert wait_for(apis[survivor], again)["status"] == "completed"
