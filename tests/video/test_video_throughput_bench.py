"""benchmarks/video_throughput.py: a smoke run on a tiny model writes one record per (task, row, prompt) as rows
finish, a rerun renders nothing and prints the same table; the independent frame reader reads drawn clips right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "video_throughput.py"
ROWS = "diffusers,ours,+prompt_cache,preset_balanced"


def _run(model: Path, results: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--num-prompts", "1", "--num-frames",
                           "5", "--size", "32", "--steps", "2", "--rows", ROWS, "--results", str(results)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _clips(results: Path) -> list[dict]:
    return [r for r in map(json.loads, results.read_text().splitlines()) if r["kind"] == "clip"]


def test_smoke_run_records_every_row_and_a_rerun_skips_them(tiny_wan_dir, tmp_path):
    results = tmp_path / "vt.jsonl"
    first = _run(tiny_wan_dir, results)
    clips = _clips(results)
    assert sorted((r["task"], r["row"]) for r in clips) == sorted(
        (task, row) for task in ("t2v", "i2v") for row in ROWS.split(","))
    by_row = {(r["task"], r["row"]): r for r in clips}
    for task in ("t2v", "i2v"):
        assert by_row[(task, "diffusers")]["psnr"] is None
        assert by_row[(task, "ours")]["psnr"] == 100.0  # nothing enabled: plain diffusers' clip exactly
        assert by_row[(task, "+prompt_cache")]["psnr"] > 60.0  # fused kernels (fp32 reordering), memo, cache
        pieces = by_row[(task, "preset_balanced")]["pieces"]
        assert {"text_encoder", "transformer", "vae_decode", "setup", "export"} <= set(pieces)
        assert by_row[(task, "preset_balanced")]["seconds"] == pytest.approx(sum(pieces.values()), rel=1e-6)
    assert "| t2v  | diffusers" in first and "1.00x" in first and "acceleration preset 'balanced'" in first
    second = _run(tiny_wan_dir, results)
    assert len(_clips(results)) == len(clips)  # nothing rendered again
    table = [line for line in first.splitlines() if line.startswith("| ")]
    assert table == [line for line in second.splitlines() if line.startswith("| ")]


def test_the_independent_reader_reads_drawn_clips_and_refuses_an_empty_one():
    import numpy as np
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from frame_reader import follows, read_colour
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from demo_models.video.data import COLOURS, held_out_combinations, render_clip, sample_spec, to_uint8

    combos = held_out_combinations()
    for index, combo in enumerate(combos):
        spec = sample_spec(combo, 17, 64, torch.Generator().manual_seed(index))
        frames = to_uint8(render_clip(spec, 17, 64)[0].permute(1, 2, 3, 0))
        assert follows(frames, combo[0], combo[2]), combo
        assert not follows(frames, combo[0], "left" if combo[2] != "left" else "right")
    assert read_colour(np.zeros((5, 32, 32, 3), np.uint8), COLOURS) is None
