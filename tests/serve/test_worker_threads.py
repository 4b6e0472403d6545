"""A spawned video worker starts with its thread count in its environment, whatever the server's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _report_threads(spec, stop) -> None:
    """A worker entry point that writes what it started with, then exits."""
    import torch

    report = {"env": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads()}
    (Path(spec.clips_dir) / f"threads-{spec.index}.json").write_text(json.dumps(report))


def test_a_worker_starts_with_its_own_thread_count(tmp_path, monkeypatch):
    from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore
    from metainfer_gen.serve.video.worker import WorkerSpec
    from metainfer_gen.serve.video.worker_pool import WorkerPool

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as a server started by a benchmark or a test runner has
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    pool = WorkerPool(lambda i: WorkerSpec(i, str(tmp_path / "jobs.sqlite3"), str(tmp_path), str(tmp_path), f"t/{i}",
                                           num_threads=2),
                      1, store, max_restarts=0, target=_report_threads).start()
    report = tmp_path / "threads-0.json"
    try:
        deadline = time.monotonic() + 120
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pool.close()
        store.close()
    assert json.loads(report.read_text()) == {"env": "2", "torch": 2}
    assert os.environ["OMP_NUM_THREADS"] == "1" and "MKL_NUM_THREADS" not in os.environ  # the server's, restored
