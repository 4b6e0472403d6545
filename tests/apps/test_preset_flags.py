"""``--preset`` on ``render``, ``serve`` (its video workers) and the demo, and ``--video-workers auto``."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.apps.test_cli import PROMPT, small


def test_the_flag_names_every_preset():
    from metainfer_gen.apps.video_args import PRESET_NAMES
    from metainfer_gen.video.presets import PRESETS

    assert PRESET_NAMES == tuple(PRESETS)


@pytest.mark.parametrize("cache", [None, "auto"])
def test_render_with_a_preset_writes_the_clip_and_an_asked_cache_replaces_the_presets(tmp_path, tiny_wan_dir,
                                                                                      cache, capsys):
    from metainfer_gen.apps.cli import main

    out = tmp_path / "clips"
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n")
    argv = ["render", "--prompts", str(prompts), "--out-dir", str(out), "--preset", "balanced", *small(tiny_wan_dir),
            "--guidance-scale", "3"] + ([] if cache is None else ["--cache", cache])
    assert main(argv) == 0
    err = capsys.readouterr().err  # what the preset turned on and why it refused the rest, said once
    assert err.count("acceleration preset 'balanced':") == 1 and "refused  step_lora: the balanced preset" in err
    record = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])
    stats = record["stats"]
    assert record["status"] == "ok" and stats["extra"]["acceleration"]["preset"] == "balanced"
    from metainfer_gen.video.presets import PRESETS

    assert stats["cache"]["policy"] == (cache or PRESETS["balanced"].step_cache)  # an asked one replaces balanced's
    assert set(stats["extra"]["seconds_by_piece"]) >= {"text_encoder", "transformer", "vae_decode", "setup"}


def test_video_workers_auto_counts_gpus_else_pairs_of_cores():
    from metainfer_gen.apps.video_serve_args import AUTO, auto_video_workers, workers_count

    assert (auto_video_workers(4, 64), auto_video_workers(0, 16), auto_video_workers(0, 1)) == (4, 8, 1)
    assert workers_count("auto") == AUTO and workers_count("3") == 3
    with pytest.raises(argparse.ArgumentTypeError):
        workers_count("-1")


def test_serve_flags_carry_the_preset_and_size_auto_workers(tmp_path):
    from metainfer_gen.apps.cli import build_parser
    from metainfer_gen.apps.video_serve_args import video_serve_config
    from metainfer_gen.serve.video.worker_pool import usable_cores

    args = build_parser().parse_args(["serve", "--llm", "none", "--data-dir", str(tmp_path), "--video-workers",
                                      "auto", "--preset", "fastest"])
    config = video_serve_config(args)
    assert config.preset == "fastest" and config.num_workers == max(1, usable_cores() // 2)


def test_a_preset_worker_runs_the_presets_cache_for_requests_that_ask_none(tiny_wan_dir, tmp_path):
    from metainfer_gen.serve.video.worker import VideoWorker, WorkerSpec

    clips = tmp_path / "clips"
    (clips / "uploads").mkdir(parents=True)
    spec = WorkerSpec(0, str(tmp_path / "jobs.sqlite3"), str(clips), str(clips / "uploads"), "test/0",
                      str(tiny_wan_dir), "cpu", None, 1, preset="quality")
    worker = VideoWorker(spec)
    try:
        assert worker.t2v.acceleration.preset == "quality" and worker.i2v.acceleration is worker.t2v.acceleration
        preset_cache = worker.t2v.step_cache
        worker._use_cache("auto")
        assert worker.t2v.step_cache.name == "auto"
        worker._use_cache("off")
        assert worker.t2v.step_cache is preset_cache and worker.i2v.step_cache is preset_cache
    finally:
        worker.store.close()


def test_the_demo_loads_its_pipelines_with_the_preset(tiny_wan_dir, tmp_path):
    from metainfer_gen.apps.demo import load_backend
    from tests.apps.test_demo_backend import demo_args

    backend = load_backend(demo_args(model=tiny_wan_dir, no_llm=True, preset="balanced"), tmp_path)
    assert backend.t2v.acceleration.preset == "balanced"
    assert backend.i2v.acceleration is backend.t2v.acceleration  # from_pipe: the same weights and hooks
