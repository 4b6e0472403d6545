"""``metainfer-gen render --cache ...``: the flag reaches the pipelines, and the manifest records the cache stats."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metainfer_gen.apps.cli import main
from metainfer_gen.apps.render import MANIFEST
from metainfer_gen.video.cache.config import PRESET_MIN_INFERENCE_STEPS


def _args(model) -> list[str]:
    # The presets' floor: "auto=1000" and "fast=1000" reuse from there on.
    return ["--model", str(model), "--device", "cpu", "--steps", str(PRESET_MIN_INFERENCE_STEPS), "--num-frames", "5",
            "--height", "32", "--width", "32", "--guidance-scale", "5"]


def test_batch_manifest_records_the_cache_stats_of_text_and_image_clips(tmp_path, tiny_wan_dir, capsys):
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "r.png")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a red circle\n{"prompt": "the circle moves", "image": "r.png"}\n')

    code = main(["render", "--prompts", str(prompts), "--out-dir", str(tmp_path / "clips"), "--cache", "auto=1000",
                 *_args(tiny_wan_dir)])

    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "clips" / MANIFEST).read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok", "ok"]
    for record in records:
        cache = record["stats"]["cache"]
        assert cache["policy"] == "auto=1000" and cache["num_reused"] > 0
        assert set(cache["per_branch"]) == {"cond", "uncond"}
        assert record["stats"]["block_evaluations"] == 2 * cache["num_computed"]  # a reused call runs no block
        assert {"step", "branch", "computed", "signal", "budget"} <= set(cache["steps"][0])


def test_single_clip_reports_reuse_and_off_reports_none(tmp_path, tiny_wan_dir, capsys):
    assert main(["render", "a red circle", "-o", str(tmp_path / "a.mp4"), "--cache", "fast=1000",
                 *_args(tiny_wan_dir)]) == 0
    assert "cache fast=1000:" in capsys.readouterr().out
    assert main(["render", "a red circle", "-o", str(tmp_path / "b.mp4"), *_args(tiny_wan_dir)]) == 0
    assert "cache" not in capsys.readouterr().out.split("transformer calls")[1]


@pytest.mark.parametrize("flags, message", [(["--num-frames", "16"], "num_frames=16 is not valid for WanPipeline"),
                                            (["--height", "481"], "height=481 is not valid for WanPipeline")])
def test_a_bad_size_for_the_embedded_model_fails_before_it_loads(flags, message, capsys, monkeypatch):
    from metainfer_gen.pipelines import TextToVideoPipeline

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded for a size its configs already rule out")

    monkeypatch.setattr(TextToVideoPipeline, "from_pretrained", no_load)
    assert main(["render", "x", "-o", "never.mp4", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [("teacache", "unknown cache policy"),
                                           ("auto=-1", "error_budget must be a finite number > 0"),
                                           ("taylorseer=0", "interval must be a whole number")])
def test_a_bad_cache_spec_is_a_usage_error_before_any_model_loads(spec, message, capsys, monkeypatch):
    from metainfer_gen.pipelines import TextToVideoPipeline

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded for a bad --cache")

    monkeypatch.setattr(TextToVideoPipeline, "from_pretrained", no_load)
    with pytest.raises(SystemExit) as exit_info:
        main(["render", "x", "--cache", spec])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
