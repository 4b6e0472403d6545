"""Soak test of ``metainfer-gen serve`` on the embedded LLM and video model: one server (started here, on a free
loopback port, one video worker) under mixed load for a bounded time, checked for leaks and lies.

    python benchmarks/serve_soak.py                                   # 2,000 LLM requests, 200 video jobs (~10 min)
    python benchmarks/serve_soak.py --llm-requests 200 --video-jobs 20   # a quick one

Load: LLM requests (half streamed, half whole, ``--disconnect-share`` of them streamed and dropped after two
chunks, every ``--bad-every``-th a bad input that must get a 400) from ``--concurrency`` clients, while video jobs
are submitted (at most ``--video-queue`` waiting) and every ``--cancel-every``-th cancelled. A warm-up share of
both runs first; the server's RSS and open fds are read (``/proc``) once idle after it, during the run every
``--sample-s`` seconds, and once idle at the end. ``/health`` is timed every 0.5 s throughout.

Pass/fail per criterion: RSS grows at most 5% from after the warm-up to the end; open fds do not grow; every KV
block is free at the end (``vllm:kv_cache_usage_perc`` 0, nothing running or waiting); every good request is
answered (200, the asked tokens) and every bad one refused (400); every video job ends completed (or cancelled
when cancelled); ``/health`` answers 200 in under 1 s every time. Exit status 1 when one fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_procs import ServerProcess, free_port, thread_env  # noqa: E402
from serve_soak_watch import Watch, diff, open_files  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402

BAD_BODIES = ({"temperature": "hot"}, {"max_tokens": -1}, {"prompt": [5, 10**9]}, {"model": "no-such-model"},
              {"top_p": 2.0})
VIDEO = {"size": "32x32", "num_frames": 5, "guidance_scale": 1.0, "fps": 4}


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else float("nan")


class Tally:
    """Counts of what the load saw, shared by the client tasks (one event loop) and the sampler thread."""

    def __init__(self):
        self.llm_done = self.llm_good_ok = self.llm_bad_ok = self.disconnected = 0
        self.llm_wrong: list[str] = []
        self.videos_done = self.videos_cancelled = 0
        self.videos_wrong: list[str] = []


async def llm_request(client, model: str, i: int, args, tally: Tally) -> None:
    body = {"model": model, "prompt": f"Request {i}: count on", "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True}
    if args.bad_every and i % args.bad_every == args.bad_every - 1:
        response = await client.post("/v1/completions", json={**body, **BAD_BODIES[i % len(BAD_BODIES)]})
        ok = response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
        tally.llm_bad_ok += ok
        if not ok:
            tally.llm_wrong.append(f"bad input {i}: {response.status_code} {response.text[:120]}")
        tally.llm_done += 1
        return
    drop = (i * 7919) % 100 < args.disconnect_share * 100  # spread over the run, the same on every run
    if i % 2 == 0 or drop:
        chunks, usage, stream = 0, {}, {"stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json={**body, **stream}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    usage = json.loads(line[6:]).get("usage") or usage
                if drop and chunks >= 2:
                    break  # leaving the block closes the connection mid-stream: the server must abort it
        if drop:
            tally.disconnected += 1
        elif response.status_code == 200 and usage.get("completion_tokens") == args.max_tokens:
            tally.llm_good_ok += 1
        else:
            tally.llm_wrong.append(f"stream {i}: {response.status_code}, {chunks} chunks, usage {usage}")
    else:
        response = await client.post("/v1/completions", json=body)
        usage = (response.json().get("usage") or {}) if response.status_code == 200 else {}
        if usage.get("completion_tokens") == args.max_tokens:
            tally.llm_good_ok += 1
        else:
            tally.llm_wrong.append(f"whole {i}: {response.status_code} {response.text[:120]}")
    tally.llm_done += 1


async def llm_load(base: str, model: str, indices: range, args, tally: Tally) -> None:
    import httpx

    todo = iter(indices)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def worker():
            for i in todo:
                try:
                    await llm_request(client, model, i, args, tally)
                except Exception as exc:  # noqa: BLE001 - a failed request is counted, the soak goes on
                    tally.llm_wrong.append(f"request {i}: {type(exc).__name__}: {exc}")
                    tally.llm_done += 1
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


async def video_load(base: str, indices: range, args, tally: Tally, deadline: float) -> None:
    import httpx

    open_jobs: dict[str, bool] = {}  # id -> cancelled
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        pending = iter(indices)
        exhausted = False
        while (open_jobs or not exhausted) and time.monotonic() < deadline:
            while not exhausted and len(open_jobs) < args.video_queue:
                i = next(pending, None)
                if i is None:
                    exhausted = True
                    break
                answer = await client.post("/v1/videos", json={"prompt": f"a red circle {i}", **VIDEO, "seed": i})
                while answer.status_code == 503 and time.monotonic() < deadline:  # the worker is still loading
                    await asyncio.sleep(1)
                    answer = await client.post("/v1/videos", json={"prompt": f"a red circle {i}", **VIDEO,
                                                                   "seed": i})
                job = answer.json()
                cancel = bool(args.cancel_every) and i % args.cancel_every == args.cancel_every - 1
                if cancel:
                    await client.delete(f"/v1/videos/{job['id']}")
                open_jobs[job["id"]] = cancel
            for video_id, cancelled in list(open_jobs.items()):
                status = (await client.get(f"/v1/videos/{video_id}")).json()["status"]
                if status in ("completed", "failed", "cancelled"):
                    del open_jobs[video_id]
                    tally.videos_done += 1
                    tally.videos_cancelled += status == "cancelled"
                    if status == "failed" or (status == "cancelled" and not cancelled):
                        tally.videos_wrong.append(f"{video_id}: {status} (cancelled: {cancelled})")
            await asyncio.sleep(0.2)
        tally.videos_wrong.extend(f"{v}: unfinished at the time limit" for v in open_jobs)


def wait_idle(base: str, timeout_s: float = 60) -> str:
    """The ``/metrics`` text once nothing runs or waits (bounded)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        idle = metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0
        if (idle and metric(text, "metainfer:video_jobs_running") == 0) or time.monotonic() > deadline:
            time.sleep(2)  # let freed buffers and closed sockets (this call's too) settle before /proc is read
            return text
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llm-requests", type=int, default=2000, help="LLM requests in all (default 2000)")
    p.add_argument("--video-jobs", type=int, default=200, help="video jobs in all (default 200)")
    p.add_argument("--concurrency", type=int, default=8, help="LLM clients at once (default 8)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per LLM request (default 128)")
    p.add_argument("--video-steps", type=int, default=8, help="denoising steps per video job (default 8)")
    p.add_argument("--disconnect-share", type=float, default=0.1, help="share of LLM requests dropped mid-stream")
    p.add_argument("--bad-every", type=int, default=20, help="every Nth LLM request is a bad input (0: none)")
    p.add_argument("--cancel-every", type=int, default=5, help="every Nth video job is cancelled (0: none)")
    p.add_argument("--video-queue", type=int, default=4, help="video jobs open at once (default 4)")
    p.add_argument("--warmup-share", type=float, default=0.1, help="share of the load run before the baseline")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between RSS / fd samples (default 30)")
    p.add_argument("--time-limit", type=float, default=1200.0,
                   help="bound of the load once the server answers, seconds (start-up: 300 s more; default 1200)")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads of the server and worker (default 1)")
    args = p.parse_args(argv)
    VIDEO["num_inference_steps"] = args.video_steps
    print(run_header())
    print(f"load: {args.llm_requests} LLM requests ({args.concurrency} clients, {args.max_tokens} tokens, "
          f"{args.disconnect_share:.0%} dropped mid-stream, every {args.bad_every}th bad), {args.video_jobs} video "
          f"jobs ({VIDEO['size']}, {VIDEO['num_frames']} frames, {VIDEO['num_inference_steps']} steps, every "
          f"{args.cancel_every}th cancelled) through 1 worker\n")
    started = time.monotonic()
    port, tally = free_port(), Tally()
    with tempfile.TemporaryDirectory(prefix="serve-soak-") as tmp:
        command = [sys.executable, "-m", "metainfer_gen.apps.cli", "serve", "--port", str(port), "--data-dir",
                   f"{tmp}/data", "--video-workers", "1", "--video-threads", str(args.threads), "--max-num-seqs",
                   str(max(16, args.concurrency)), "--log-level", "warning"]
        with ServerProcess.start("ours", command, thread_env(args.threads), port, Path(tmp) / "server.log", 300) as srv:
            deadline = time.monotonic() + args.time_limit  # the load's bound, from the moment the server answers
            base = srv.base_url.removesuffix("/v1")
            model = srv.model.split(" + ")[0]
            watch = Watch(base, srv.process.pid, args.sample_s, tally)
            n_llm, n_vid = int(args.llm_requests * args.warmup_share), int(args.video_jobs * args.warmup_share)

            async def phase(llm: range, videos: range) -> None:
                await asyncio.gather(llm_load(base, model, llm, args, tally),
                                     video_load(base, videos, args, tally, deadline))

            asyncio.run(phase(range(n_llm), range(n_vid)))
            wait_idle(base)
            base_rss, base_fds = watch.sample("after warm-up", settled=True)
            base_files = open_files(srv.process.pid)
            watch.phase = "load"
            asyncio.run(phase(range(n_llm, args.llm_requests), range(n_vid, args.video_jobs)))
            watch.phase = ""
            text = wait_idle(base)
            end_rss, end_fds = watch.sample("end (idle)", settled=True)
            end_files = open_files(srv.process.pid)
            watch.stop()
    print_table(["t (s)", "phase", "server RSS (MiB)", "open fds", "LLM requests done", "video jobs done",
                 "max /health so far (ms)"], watch.rows)
    num_bad = args.llm_requests // args.bad_every if args.bad_every else 0
    growth = end_rss / base_rss - 1
    checks = [
        (f"RSS after warm-up {base_rss:.1f} MiB -> end {end_rss:.1f} MiB ({growth:+.1%}; at most +5%)", growth <= 0.05),
        (f"open fds after warm-up {base_fds} -> end {end_fds} (no growth; new: {diff(end_files, base_files)}, "
         f"gone: {diff(base_files, end_files)})", end_fds <= base_fds),
        (f"KV cache usage at the end {metric(text, 'vllm:kv_cache_usage_perc'):.3f} (every block free), running "
         f"{metric(text, 'vllm:num_requests_running'):.0f}, waiting {metric(text, 'vllm:num_requests_waiting'):.0f}",
         metric(text, "vllm:kv_cache_usage_perc") == 0 and metric(text, "vllm:num_requests_running") == 0),
        (f"LLM: {tally.llm_good_ok} good answered, {tally.llm_bad_ok} of {num_bad} bad refused with 400, "
         f"{tally.disconnected} dropped; wrong: {len(tally.llm_wrong)} {tally.llm_wrong[:3]}",
         not tally.llm_wrong and tally.llm_done == args.llm_requests),
        (f"video: {tally.videos_done} of {args.video_jobs} finished ({tally.videos_cancelled} cancelled); wrong: "
         f"{len(tally.videos_wrong)} {tally.videos_wrong[:3]}",
         not tally.videos_wrong and tally.videos_done == args.video_jobs),
        (f"/health: slowest {watch.health_max_s * 1000:.0f} ms (under 1 s), not 200: {len(watch.health_bad)} "
         f"{watch.health_bad[:3]}", watch.health_max_s < 1.0 and not watch.health_bad),
    ]
    print()
    for line, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {line}")
    print(run_footer(time.monotonic() - started))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
