"""Clips per hour through ``/v1/videos`` (1 worker with every core, 2 workers with a core each) against the batch
CLI (``metainfer-gen render --prompts``) on the same 8 prompts and seeds, step cache off and ``auto``; then each
acceleration preset (``--preset`` on both sides, the server at ``--video-workers auto``, the preset's own steps).

Each row renders the 8 clips once, after its model is loaded and warm: the CLI's time is the sum of its
manifest's per-clip ``seconds`` (render + MP4 write, load and a first warm-up clip excluded); the API's is the wall time
from the first ``POST /v1/videos`` to the last job seen ``completed`` (workers loaded and warmed up by one job first).
The API overhead per clip is the API's time beyond rendering: (wall - sum of the workers' render seconds / workers) / 8,
in ms and as a share of a clip's render time (the render seconds are measured inside the workers, claim to clip on disk,
so the figure holds however loaded the machine is; the "vs CLI" column compares against the CLI's run, which a shared
machine moves more). Served clips are compared with the CLI's clip of the same prompt and seed, decoded (max absolute
difference in uint8 levels). Both sides run under the host allocator ``metainfer-gen`` runs under
(:func:`metainfer_gen.host_allocator.reexec`: the CLI re-executes itself, this script the same way, so the in-process
server's spawned workers get it as ``metainfer-gen serve``'s do).

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


def cli_batch(out_dir: Path, cache: str, threads: int, steps: int | None, preset: str | None = None
              ) -> tuple[float, dict[int, Path]]:
    """(seconds of the 8 clips from the manifest, {seed: clip}) of one ``render --prompts`` run (``steps`` None:
    the preset's or the model's)."""
    out_dir.mkdir(parents=True)
    prompts = out_dir / "prompts.jsonl"
    warm = json.dumps({"prompt": "warm up", "seed": 99, "name": "warmup"}) + "\n"  # its first-call cost, untimed
    prompts.write_text(warm + "".join(json.dumps({"prompt": p, "seed": i, "name": f"clip{i}"}) + "\n"
                                      for i, p in enumerate(PROMPTS)))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    extra = (["--steps", str(steps)] if steps else []) + (["--preset", preset] if preset else [])
    subprocess.run([sys.executable, "-m", "metainfer_gen.apps.cli", "render", "--prompts", str(prompts),
                    "--out-dir", str(out_dir / "clips"), "--cache", cache, "--device", "cpu", *extra],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=JOB_TIMEOUT_S)
    records = [json.loads(line) for line in (out_dir / "clips" / "manifest.jsonl").read_text().splitlines()]
    records = [r for r in records if r["seed"] != 99]
    assert all(r["status"] == "ok" for r in records), records
    return sum(r["seconds"] for r in records), {r["seed"]: out_dir / "clips" / r["path"] for r in records}


def wait_all(http, ids: list[str]) -> None:
    """Until every job of ``ids`` is completed. Jobs are claimed in order, so each poll reads the pending jobs in
    that order and stops at the first unfinished one (a poll of every job each 20 ms took a core's tenth from the
    workers it measures)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    pending = list(ids)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} jobs unfinished after {JOB_TIMEOUT_S} s")
        while pending:
            body = http.get(f"/v1/videos/{pending[0]}").json()
            if body["status"] in ("queued", "in_progress"):
                break
            assert body["status"] == "completed", body
            pending.pop(0)
        time.sleep(0.05)


def api_run(data_dir: Path, cache: str, workers: int, threads: int, steps: int | None, preset: str | None = None
            ) -> tuple[float, dict[int, Path], float]:
    """(wall seconds of the 8 clips, {seed: clip}, their render seconds summed over the workers) through a live
    server."""
    import httpx

    from metainfer_gen.apps.demo_limits import DemoLimits
    from metainfer_gen.serve.server import LLMServer, ServeConfig
    from metainfer_gen.serve.video.service import VideoServeConfig

    video = VideoServeConfig(data_dir=data_dir, limits=DemoLimits(), num_workers=workers, num_threads=threads,
                             device="cpu", preset=preset)
    with LLMServer.start(ServeConfig(port=0, with_llm=False, video=video)) as server:
        server.video.wait_ready(300, all_workers=True)
        with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=60) as http:
            fields = {"cache": cache, **({"num_inference_steps": steps} if steps else {})}
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
    parser.add_argument("--presets", nargs="*", default=["balanced", "fastest"],
                        help="acceleration presets (rows at their own steps; the server at --video-workers auto)")
    args = parser.parse_args(argv)
    if argv is None:
        from metainfer_gen import host_allocator

        host_allocator.reexec()
    from metainfer_gen.apps.video_serve_args import auto_video_workers
    print(run_header())
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve_video_") as tmp:
        auto = auto_video_workers(0, args.cores)
        specs = [(cache, None, args.steps, (1, 2)) for cache in args.caches] + \
            [("off", preset, None, (auto,)) for preset in args.presets]
        for cache, preset, steps, worker_counts in specs:
            label = f"preset {preset}" if preset else cache
            cli_s, cli_clips = cli_batch(Path(tmp) / f"cli_{label}", cache, args.cores, steps, preset)
            rows.append([f"CLI render --prompts, {args.cores} threads", label, f"{cli_s:.2f}",
                         f"{8 * 3600 / cli_s:,.0f}", "1.00x", "-", "-", "-"])
            one = None
            for workers in worker_counts:
                threads = max(1, args.cores // workers)
                wall, clips, render = api_run(Path(tmp) / f"api_{label}_{workers}", cache, workers, threads, steps,
                                              preset)
                diff = max(max_difference(clips[i], cli_clips[i]) for i in range(len(PROMPTS)))
                overhead = (wall - render / workers) / len(PROMPTS)
                one = wall if one is None else one
                rows.append([f"API, {workers} worker{'s' if workers > 1 else ''} x {threads} thread"
                             f"{'s' if threads > 1 else ''}{' (auto)' if preset else ''}", label, f"{wall:.2f}",
                             f"{8 * 3600 / wall:,.0f}", f"{cli_s / wall:.2f}x", f"{one / wall:.2f}x",
                             f"{overhead * 1000:.0f} ({overhead / (render / len(PROMPTS)) * 100:.1f}%)", str(diff)])
                print(f"# {label}, {workers} workers: {wall:.2f} s, {render / len(PROMPTS):.3f} s/clip rendering in "
                      f"the workers", flush=True)
    print(f"8 prompts of the embedded model (17 frames 64x64; {args.steps} steps, guidance 4, except the presets' rows "
          f"at each preset's own: fastest fuses the step LoRA, 4 unguided steps), seeds 0-7; seconds = the 8 clips, "
          f"load excluded")
    print_table(["row", "cache", "seconds", "clips/hour", "vs CLI", "vs 1 worker", "API overhead ms/clip",
                 "max diff vs CLI clip (uint8)"], rows)
    print(run_footer(time.time() - started))


if __name__ == "__main__":
    main()
