"""A video fleet on one machine: clips per hour with 1 host and with 2 hosts (network namespaces, each its own
``serve`` with one worker pinned to its own core by ``taskset``, one PostgreSQL job store reached over the veth
links, one clips folder), 16 prompts of the embedded model, step cache off and ``auto``; the claim latency from
``queued`` to ``in_progress`` with an idle worker (LISTEN/NOTIFY on PostgreSQL against SQLite's polling); and the
store's own time per job (the statements one job costs: add, claim, a progress update per step, complete, a read).

Clips per hour: the wall time from the first ``POST /v1/videos`` to the last job seen ``completed`` (every worker
loaded and warmed up by one job first). Claim latency: a job added straight to the store while the workers idle,
from its ``queued_at`` to its ``claimed_at`` (both on the database's clock; 40 jobs, each finished before the next).
Needs root (namespaces), Debian's PostgreSQL and the fleet extra.

    python benchmarks/fleet_video.py | tee benchmarks/results/fleet_video.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from table import print_table, run_footer, run_header  # noqa: E402

PROMPTS = [f"a {colour} {shape} moving {direction}" for colour in ("red", "blue", "green", "yellow")
           for shape, direction in (("circle", "right"), ("square", "up"), ("triangle", "left"), ("circle", "down"))]
JOB_TIMEOUT_S = 900
TINY = {"num_frames": 5, "size": "32x32", "num_inference_steps": 2, "guidance_scale": 1.0}


def wait_all(store, ids: list[str], timeout_s: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while any(not store.get(v).status.finished for v in ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs unfinished after {timeout_s} s")
        time.sleep(0.05)


def clips_run(fleet, store, num_hosts: int, cache: str) -> tuple[float, list[int], float]:
    """(wall seconds of the 16 clips, clips per host, mean render seconds per clip in the workers)."""
    import httpx

    apis = [httpx.Client(base_url=fleet.url(i), timeout=60) for i in range(num_hosts)]
    try:
        warm = [apis[i].post("/v1/videos", json={"prompt": "warm up", "seed": 99, "cache": cache}).json()["id"]
                for i in range(num_hosts)]
        wait_all(store, warm)
        started = time.perf_counter()
        ids = [apis[i % num_hosts].post("/v1/videos", json={"prompt": p, "seed": i, "cache": cache}).json()["id"]
               for i, p in enumerate(PROMPTS)]
        wait_all(store, ids)
        wall = time.perf_counter() - started
    finally:
        for api in apis:
            api.close()
    jobs = [store.get(v) for v in ids]
    if any(j.status.value != "completed" or j.renders != 1 for j in jobs):
        raise RuntimeError(f"not every job completed exactly once: {[(j.status, j.renders) for j in jobs]}")
    per_host = [sum(fleet.host_of(j.owner) == h for j in jobs) for h in range(num_hosts)]
    return wall, per_host, statistics.mean(j.render_seconds for j in jobs)


def claim_latencies(store, request: dict, samples: int = 40) -> list[float]:
    """Seconds from a job entering the queue to a worker claiming it, with the workers idle (both instants on the
    database's clock: the job's ``queued_at`` and ``claimed_at``, so this process's polling adds nothing)."""
    found = []
    for _ in range(samples):
        job_id = f"video_{uuid.uuid4()}"
        store.add(job_id, request)
        wait_all(store, [job_id], 60)
        job = store.get(job_id)
        found.append(job.claimed_at - job.queued_at)
        time.sleep(0.05)  # the worker is back to idle
    return found


def store_seconds_per_job(store, steps: int = 20, jobs: int = 50) -> float:
    """The store's time for one job's statements, run back to back (no rendering)."""
    started = time.perf_counter()
    for _ in range(jobs):
        job_id = f"bench_{uuid.uuid4()}"
        store.add(job_id, {"prompt": "p"})
        job = store.claim(0, "bench/0")
        while job is not None and job.id != job_id:  # leave the benchmark's queue as it found it
            store.complete(job, 0.0)
            job = store.claim(0, "bench/0")
        for step in range(steps):
            store.set_progress(job, (step + 1) * 100 // steps)
        store.complete(job, 0.0)
        store.get(job_id)
    return (time.perf_counter() - started) / jobs


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def sqlite_side(folder: Path, request: dict) -> tuple[list[float], float]:
    """Claim latencies and store time per job of a single server's SQLite store (one in-process worker)."""
    from metainfer_gen.apps.demo_limits import DemoLimits
    from metainfer_gen.serve.video.service import VideoServeConfig, VideoService
    from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore

    service = VideoService.start(VideoServeConfig(data_dir=folder / "sqlite", limits=DemoLimits(), num_workers=1,
                                                  num_threads=1, device="cpu"))
    try:
        service.wait_ready(600, all_workers=True)
        latencies = claim_latencies(service.store, request)
    finally:
        service.close()
    bare = SQLiteJobStore(folder / "bench.sqlite3")
    try:
        return latencies, store_seconds_per_job(bare)
    finally:
        bare.close()


def main(argv: list[str] | None = None) -> None:
    from metainfer_gen.pipelines.loading import default_model_path
    from metainfer_gen.serve.video.stores import open_job_store
    from tests.serve.fleet_harness import Fleet

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", nargs="+", default=["off", "auto"], help="step-cache policies (rows)")
    parser.add_argument("--cpus", nargs=2, default=["0", "1"], help="taskset CPU lists of host 0 and host 1")
    parser.add_argument("--latency-only", action="store_true", help="skip the clips-per-hour rows")
    args = parser.parse_args(argv)
    print(run_header())
    started = time.time()
    rows, latency_rows = [], []
    with tempfile.TemporaryDirectory(prefix="fleet_video_") as tmp:
        fleet = Fleet(default_model_path(), Path(tmp), num_hosts=2, lease_s=30.0, cpus=args.cpus)
        try:
            store = open_job_store(fleet.store_url)
            walls: dict[str, float] = {}
            for num_hosts in (1, 2):
                fleet.start(num_hosts - 1)
                fleet.wait_workers_ready()
                for cache in [] if args.latency_only else args.caches:
                    wall, per_host, render = clips_run(fleet, store, num_hosts, cache)
                    walls.setdefault(cache, wall)
                    rows.append([f"{num_hosts} host{'s' if num_hosts > 1 else ''} x 1 worker", cache,
                                 f"{wall:.2f}", f"{len(PROMPTS) * 3600 / wall:,.0f}", f"{walls[cache] / wall:.2f}x",
                                 "/".join(map(str, per_host)), f"{render:.3f}"])
                    print(f"# {num_hosts} hosts, cache {cache}: {wall:.2f} s", flush=True)
            request = {"prompt": "claim", "negative_prompt": None, "num_frames": 5, "height": 32, "width": 32,
                       "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 0, "fps": 8.0}
            pg = claim_latencies(store, request)
            bench_store = open_job_store(fleet.postgres.create_database("storebench"))
            pg_store_s = store_seconds_per_job(bench_store)
            bench_store.close()
            store.close()
        finally:
            fleet.close()
        lite, lite_store_s = sqlite_side(Path(tmp), request)
    for name, values, per_job in (("PostgreSQL, LISTEN/NOTIFY (2 hosts idle)", pg, pg_store_s),
                                  ("SQLite, 50 ms polling (1 worker idle)", lite, lite_store_s)):
        latency_rows.append([name, str(len(values)), f"{percentile(values, 50) * 1000:.1f}",
                             f"{percentile(values, 99) * 1000:.1f}", f"{per_job * 1000:.1f}"])
    if rows:
        print(f"16 prompts of the embedded model (17 frames 64x64, 20 steps, guidance 4), seeds 0-15; "
              f"hosts pinned to CPUs {args.cpus}")
        print_table(["row", "cache", "seconds", "clips/hour", "vs 1 host", "clips per host", "render s/clip"], rows)
    print("claim latency: queued_at to claimed_at (database clock), idle workers; store time per job: add + claim + "
          "20 progress updates + complete + read, back to back")
    print_table(["store", "samples", "claim p50 ms", "claim p99 ms", "store ms/job"], latency_rows)
    print(run_footer(time.time() - started))


if __name__ == "__main__":
    main()
