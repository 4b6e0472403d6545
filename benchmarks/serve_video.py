"""Clips per hour through ``/v1/videos`` (1 worker with every core, 2 workers with a core each) against the batch
CLI (``metainfer-gen render --prompts``) on the same 8 prompts and seeds, step cache off and ``auto``.

Each row renders the 8 clips once, after its model is loaded and warm: the CLI's time is the sum of its
manifest's per-clip ``seconds`` (render + MP4 write, load excluded); the API's is the wall time from the first
``POST /v1/videos`` to the last job seen ``completed`` (workers loaded and warmed up by one job first). The API
overhead per clip is the API's time beyond rendering: (wall - sum of the workers' render seconds / workers) / 8, in
ms and as a share of a clip's render time (the render seconds are measured inside the workers, claim to clip on
disk, so the figure holds however loaded the machine is; the "vs CLI" column compares against the CLI's run, which
a shared machine moves more). Served clips are compared with the CLI's clip of the same prompt and seed, decoded
(max absolute difference in uint8 levels).

    python benchmarks/serve_video.py | tee benchmarks/results/serve_video.txt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table import print_table, run_footer, run_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [f"a {colour} {shape} moving {direction}" for colour, shape, direction in (
    ("red", "circle", "right"), ("blue", "square", "up"), ("green", "triangle", "left"), ("yellow", "circle", "down"),
    ("purple", "square", "right"), ("orange", "triangle", "up"), ("red", "square", "left"), ("blue", "circle", "down"))]
JOB_TIMEOUT_S = 600


def cli_batch(out_dir: Path, cache: str, threads: int, steps: int) -> tuple[float, dict[int, Path]]:
    """(seconds of the 8 clips from the manifest, {seed: clip}) of one ``render --prompts`` run."""
    out_dir.mkdir(parents=True)
    prompts = out_dir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "seed": i, "name": f"clip{i}"}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "metainfer_gen.apps.cli", "render", "--prompts", str(prompts),
                    "--out-dir", str(out_dir / "clips"), "--cache", cache, "--device", "cpu", "--steps", str(steps)],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=JOB_TIMEOUT_S)
    records = [json.loads(line) for line in (out_dir / "clips" / "manifest.jsonl").read_text().splitlines()]
    assert all(r["status"] == "ok" for r in records), records
    return sum(r["seconds"] for r in records), {r["seed"]: out_dir / "clips" / r["path"] for r in records}


def wait_all(http, ids: list[str]) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    pending = set(ids)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} jobs unfinished after {JOB_TIMEOUT_S} s")
        for video_id in list(pending):
            status = http.get(f"/v1/videos/{video_id}").json()["status"]
            if status != "queued" and status != "in_progress":
                assert status == "completed", http.get(f"/v1/videos/{video_id}").json()
                pending.discard(video_id)
        time.sleep(0.02)


def api_run(data_dir: Path, cache: str, workers: int, threads: int, steps: int
            ) -> tuple[float, dict[int, Path], float]:
    """(wall seconds of the 8 clips, {seed: clip}, their render seconds summed over the workers) through a live
    server."""
    import httpx

    from metainfer_gen.apps.demo_limits import DemoLimits
    from metainfer_gen.serve.server import LLMServer, ServeConfig
    from metainfer_gen.serve.video.service import VideoServeConfig

    video = VideoServeConfig(data_dir=data_dir, limits=DemoLimits(), num_workers=workers, num_threads=threads,
                             device="cpu")
    with LLMServer.start(ServeConfig(port=0, with_llm=False, video=video)) as server:
        server.video.wait_ready(300, all_workers=True)
        with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=60) as http:
            fields = {"cache": cache, "num_inference_steps": steps}
            warmed: set[int] = set()
            for _ in range(4 * workers):  # until each worker has paid its first-call cost (bounded)
                warm = [http.post("/v1/videos", json={"prompt": "warm up", "seed": 99, **fields}).json()["id"]
                        for _ in range(workers)]
                wait_all(http, warm)
                warmed |= {server.video.store.get(v).worker for v in warm}
                if len(warmed) == workers:
                    break
            started = time.perf_counter()
            ids = [http.post("/v1/videos", json={"prompt": p, "seed": i, **fields}).json()["id"]
                   for i, p in enumerate(PROMPTS)]
            wait_all(http, ids)
            seconds = time.perf_counter() - started
        jobs = [server.video.store.get(video_id) for video_id in ids]
        assert all(j.renders == 1 for j in jobs)
        clips = {i: server.video.clip_path(j) for i, j in enumerate(jobs)}
        render = float(sum(j.render_seconds for j in jobs))
    return seconds, clips, render


def max_difference(a: Path, b: Path) -> int:
    from metainfer_gen.video.export import read_video

    x, y = read_video(a).astype(np.int16), read_video(b).astype(np.int16)
    return int(np.abs(x - y).max()) if x.shape == y.shape else 255


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", nargs="+", default=["off", "auto"], help="step-cache policies (rows)")
    parser.add_argument("--cores", type=int, default=2, help="cores to split between the workers (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per clip (default 20, the model's)")
    args = parser.parse_args(argv)
    print(run_header())
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve_video_") as tmp:
        for cache in args.caches:
            cli_s, cli_clips = cli_batch(Path(tmp) / f"cli_{cache}", cache, args.cores, args.steps)
            rows.append([f"CLI render --prompts, {args.cores} threads", cache, f"{cli_s:.2f}",
                         f"{8 * 3600 / cli_s:,.0f}", "1.00x", "-", "-", "-"])
            one = None
            for workers in (1, 2):
                threads = max(1, args.cores // workers)
                wall, clips, render = api_run(Path(tmp) / f"api_{cache}_{workers}", cache, workers, threads, args.steps)
                diff = max(max_difference(clips[i], cli_clips[i]) for i in range(len(PROMPTS)))
                overhead = (wall - render / workers) / len(PROMPTS)
                one = wall if workers == 1 else one
                rows.append([f"API, {workers} worker{'s' if workers > 1 else ''} x {threads} thread"
                             f"{'s' if threads > 1 else ''}", cache, f"{wall:.2f}", f"{8 * 3600 / wall:,.0f}",
                             f"{cli_s / wall:.2f}x", f"{one / wall:.2f}x",
                             f"{overhead * 1000:.0f} ({overhead / (render / len(PROMPTS)) * 100:.1f}%)", str(diff)])
                print(f"# {cache}, {workers} workers: {wall:.2f} s, {render / len(PROMPTS):.3f} s/clip rendering in "
                      f"the workers", flush=True)
    print(f"8 prompts of the embedded model (17 frames 64x64, {args.steps} steps, guidance 4), seeds 0-7; "
          f"seconds = the 8 clips, load excluded")
    print_table(["row", "cache", "seconds", "clips/hour", "vs CLI", "vs 1 worker", "API overhead ms/clip",
                 "max diff vs CLI clip (uint8)"], rows)
    print(run_footer(time.time() - started))


if __name__ == "__main__":
    main()
