"""A dead or absent peer makes the others raise within the timeout (never hang), and no segment is left behind."""

from __future__ import annotations

import os

from metainfer_gen.collectives.shm import SHM_DIR, list_segments, sweep_stale_segments
from tests.collectives.harness import run_ranks

TIMEOUT_S = 5.0


def _ours() -> list[str]:
    return [n for n in list_segments() if f"ppid{os.getpid()}" in n]  # segments of jobs this test launched


def test_killed_rank_raises_within_timeout_and_leaves_no_segment(tmp_path):
    results = run_ranks("killed_rank", tmp_path, timeout_s=120, expect_reports=1, peer_timeout_s=TIMEOUT_S)
    out = results[0]
    assert out["segments_while_running"] == []  # unlinked as soon as both ranks attached
    assert out["calls"] >= 50 and "died" in out["error"]
    assert out["raised_after_s"] < TIMEOUT_S  # the death check fires before the timeout
    assert out["second_call"] == "CollectiveAborted"  # the communicator stays broken, it does not hang
    assert out["shutdown_s"] < TIMEOUT_S
    assert not os.path.exists(os.path.join("/dev/shm", out["job_segment"]))
    assert _ours() == []


def test_silent_peer_times_out_and_late_peer_sees_abort(tmp_path):
    results = run_ranks("silent_peer", tmp_path, timeout_s=120, peer_timeout_s=2.0)
    assert results[0]["raised"] == "CollectiveTimeout" and "did not reach" in results[0]["message"]
    assert 1.5 < results[0]["after_s"] < 2.0 + 1.5
    assert results[1]["raised"] == "CollectiveAborted" and results[1]["after_s"] < 2.0 + 1.0 + 1.0
    assert _ours() == []


def test_sweep_removes_segments_of_dead_creators_only(tmp_path):
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    dead = f"mig-coll-ppid1-test-{dead_pid}-00ff"
    alive = f"mig-coll-ppid1-test-{os.getpid()}-00fe"
    for name in (dead, alive):
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        removed = sweep_stale_segments()
        assert dead in removed and alive not in removed
        assert alive in list_segments() and dead not in list_segments()
    finally:
        for name in (dead, alive):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
