"""Data-parallel batch rendering: ``torchrun --nproc-per-node 2 -m metainfer_gen.apps.cli render --prompts ...`` on
CPU (gloo) splits the prompt file over the ranks, writes one manifest, and a run killed half way resumes without
rendering any finished clip again. The sharding and the shared manifest are also checked in one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metainfer_gen.apps.render import MANIFEST, Manifest, Shard, parse_prompt_file, render_batch
from tests.video.mp4_inspect import ffmpeg_stream_info

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--device", "cpu", "--steps", "2", "--num-frames", "5", "--height", "32", "--width", "32"]


def _records(manifest: Path) -> list[dict]:
    if not manifest.exists():
        return []
    return [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines()]


def _ok_records(manifest: Path) -> dict[str, dict]:
    return {r["job_id"]: r for r in _records(manifest) if r["status"] == "ok"}


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (torchrun's workers), from /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _kill_job(agent: subprocess.Popen) -> None:
    """SIGKILL torchrun's workers (each in its own session, with its ffmpeg encoder) and then torchrun itself."""
    for worker in _children(agent.pid):
        try:
            os.killpg(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()


def test_torchrun_render_splits_the_prompts_into_one_manifest_and_resumes_after_a_kill(tmp_path, tiny_wan_dir):
    from metainfer_gen.collectives.distributed import free_port

    lines = [f"clip {i}: a red circle moving right" if i % 2 else
             json.dumps({"prompt": f"clip {i}: a blue square moving up", "seed": 100 + i}) for i in range(7)]
    lines.insert(3, '{"prompt": "bad seed", "seed": "four"}')
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    jobs = parse_prompt_file(prompts, defaults={"num_inference_steps": 2, "num_frames": 5, "height": 32, "width": 32})
    out = tmp_path / "clips"
    manifest = out / MANIFEST
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "METAINFER_COLLECTIVES_TUNE": "0",
           "METAINFER_COLLECTIVES_CACHE": str(tmp_path / "collectives.json"),
           "METAINFER_COLLECTIVES_TIMEOUT": "600"}  # a loaded machine may start one rank minutes after the other

    def command() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), "-m", "metainfer_gen.apps.cli", "render", "--prompts", str(prompts),
                "--out-dir", str(out), "--model", str(tiny_wan_dir), *SMALL]

    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(command(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 900  # a liveness guard for loaded machines
            while len(_ok_records(manifest)) < 2:
                assert first.poll() is None, "the first run ended before it could be killed"
                assert time.monotonic() < deadline, "no 2 clips within 900 s"
                time.sleep(0.02)
        finally:
            _kill_job(first)
    before = _ok_records(manifest)
    assert 2 <= len(before) < 7, f"{len(before)} clips done at the kill: nothing left to resume"
    assert {r["dp_rank"] for r in before.values()} <= {0, 1}
    before_files = {r["path"]: ((out / r["path"]).stat().st_mtime_ns, (out / r["path"]).stat().st_ino)
                    for r in before.values()}

    rerun = subprocess.run(command(), env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=900)

    assert rerun.returncode != 0  # the bad line failed: every rank exits 1, and torchrun with them
    summary = json.loads(rerun.stdout.decode().splitlines()[-1])  # printed once, by rank 0
    assert (summary["rendered"], summary["skipped"], summary["failed"]) == (7 - len(before), len(before), 1)
    assert (summary["world_size"], summary["data_parallel_size"], summary["manifest"]) == (2, 2, str(manifest))
    assert sum(summary["rendered_per_rank"]) == summary["rendered"]
    records = _records(manifest)
    # One manifest, one record per job, in prompt-file order.
    assert [r["job_id"] for r in records] == [job.job_id for job in jobs]
    assert [r["line"] for r in records] == list(range(1, 9))
    assert [r["line"] for r in records if r["status"] == "error"] == [4]
    assert records[3]["error"] == "ValueError: line 4: 'seed' must be an integer; got 'four'"
    # The rerun split the unfinished jobs round-robin over the two ranks.
    pending = [r for r in records if r["job_id"] not in before]
    assert [r["dp_rank"] for r in pending] == [i % 2 for i in range(len(pending))]
    # Clips finished before the kill were not rendered again: same records, same files.
    assert {r["job_id"]: r for r in records if r["job_id"] in before} == before
    assert {p: ((out / p).stat().st_mtime_ns, (out / p).stat().st_ino) for p in before_files} == before_files
    # Nothing partial, temporary or left locked: the manifest and the 7 clips.
    ok_paths = sorted(r["path"] for r in records if r["status"] == "ok")
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, *ok_paths])
    for name in ok_paths:
        info = ffmpeg_stream_info(out / name)
        assert (info["codec"], info["frames"], info["width"], info["height"]) == ("h264", 5, 32, 32)


# ------------------------------------------------------------------------------------- in one process, no model


class _Renders:
    """A ``get_pipeline`` that records which prompts reach it and fails every one (no model needed)."""

    def __init__(self):
        self.prompts: list[str] = []

    def __call__(self, task):
        def call(*args, **kwargs):
            self.prompts.append(args[-1])
            raise RuntimeError("no model here")

        return call


def _prompt_file(folder: Path, lines: list[str]) -> Path:
    path = folder / "prompts.txt"
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def test_shards_take_unfinished_jobs_round_robin_and_share_the_manifest(tmp_path):
    """Two threads stand in for two ranks: a barrier as ``sync``, the real file lock between them."""
    import threading

    jobs = parse_prompt_file(_prompt_file(tmp_path, [f"prompt {i}" for i in range(5)]))
    out = tmp_path / "clips"
    barrier = threading.Barrier(2, timeout=60)
    seen, summaries = [_Renders(), _Renders()], [None, None]

    def rank(i: int) -> None:
        summaries[i] = render_batch(jobs, out, seen[i], progress=False, shard=Shard(i, 2, sync=barrier.wait))

    threads = [threading.Thread(target=rank, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)

    assert [r.prompts for r in seen] == [["prompt 0", "prompt 2", "prompt 4"], ["prompt 1", "prompt 3"]]
    assert [s.failed for s in summaries] == [3, 2]
    records = _records(out / MANIFEST)
    assert [(r["prompt"], r["dp_rank"], r["status"]) for r in records] == \
        [(f"prompt {i}", i % 2, "error") for i in range(5)]
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST]  # the lock is gone once the batch is done


def test_a_cfg_partner_renders_but_writes_nothing(tmp_path):
    jobs = parse_prompt_file(_prompt_file(tmp_path, ["one", "two"]))
    renders = _Renders()
    summary = render_batch(jobs, tmp_path / "clips", renders, progress=False,
                           shard=Shard(index=0, count=1, writes=False, sync=lambda: None))

    assert renders.prompts == ["one", "two"]  # it computed its branch of every job
    assert (summary.rendered, summary.failed, summary.skipped) == (0, 0, 0)  # its peer counts them
    assert not (tmp_path / "clips" / MANIFEST).exists()


def test_a_shared_manifest_keeps_what_other_processes_wrote(tmp_path):
    jobs = parse_prompt_file(_prompt_file(tmp_path, ["a", "b"]))
    mine, theirs = Manifest(tmp_path, shared=True), Manifest(tmp_path, shared=True)
    mine.write(jobs, {"job_id": jobs[0].job_id, "status": "ok", "path": "a.mp4"})
    theirs.write(jobs, {"job_id": jobs[1].job_id, "status": "ok", "path": "b.mp4"})  # read before mine wrote
    mine.write(jobs)

    assert [r["path"] for r in _records(tmp_path / MANIFEST)] == ["a.mp4", "b.mp4"]
    assert [r["line"] for r in _records(tmp_path / MANIFEST)] == [1, 2]


def test_shard_bounds_are_checked():
    with pytest.raises(ValueError, match="shard index 2 of 2"):
        Shard(index=2, count=2)
