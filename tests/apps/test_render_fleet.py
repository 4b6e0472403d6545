"""``render --prompts --job-store`` without a fleet of machines: a SQLite store and one in-process worker thread
stand in for the fleet. A second run submits nothing and copies nothing; a line the fleet cannot take (an image)
is recorded as an error, not queued."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi", reason="the fleet render path uses the server's request checks (the serve extra)")


def test_a_rerun_submits_nothing_twice_and_copies_only_what_is_missing(tiny_wan_dir, tmp_path):
    from metainfer_gen.apps.render import parse_prompt_file
    from metainfer_gen.apps.render_fleet import ID_PREFIX, render_through_fleet, request_checks
    from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore
    from metainfer_gen.serve.video.worker import VideoWorker, WorkerSpec

    clips, address = tmp_path / "clips", str(tmp_path / "jobs.sqlite3")
    (clips / "uploads").mkdir(parents=True)
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"line {i}", "num_frames": 5, "height": 32, "width": 32, "num_inference_steps": 2,
              "guidance_scale": 1.0} for i in range(3)] + [{"prompt": "with an image", "image": "ref.png"}]
    (tmp_path / "ref.png").write_bytes(b"not read: refused before")
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    jobs = parse_prompt_file(prompts, base_seed=5)
    store = SQLiteJobStore(address)
    worker = VideoWorker(WorkerSpec(0, address, str(clips), str(clips / "uploads"), "test/0", str(tiny_wan_dir),
                                    "cpu", None, 1))
    stop = threading.Event()

    def serve() -> None:
        for _ in range(2000):  # bounded: at most 2000 rounds of claim-or-wait
            if stop.is_set():
                return
            if not worker.run_one():
                worker.store.wait_for_work(0.05)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        checks = request_checks(str(tiny_wan_dir), ("off",))
        first = render_through_fleet(jobs, tmp_path / "out", store, clips, checks, progress=False, timeout_s=120)
        assert (first.rendered, first.failed, first.skipped) == (3, 1, 0)
        copied = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.mp4")}
        second = render_through_fleet(jobs, tmp_path / "out", store, clips, checks, progress=False, timeout_s=120)
        assert (second.rendered, second.failed, second.skipped) == (0, 1, 3)
        assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.mp4")} == copied
    finally:
        stop.set()
        thread.join(60)
        worker.store.close()
    batch = [j for j in store.list(100) if j.id.startswith(ID_PREFIX)]
    store.close()
    assert len(batch) == 3 and [j.renders for j in batch] == [1, 1, 1]
    records = [json.loads(r) for r in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok", "ok", "ok", "error"]
    assert "not rendered through --job-store" in records[3]["error"]
