"""The step cache's calibration: fitting, the JSON file beside the model, its use by "auto", and the CLI."""

from __future__ import annotations

import json
import shutil

import pytest

from metainfer_gen.video.cache import StepCacheConfig
from metainfer_gen.video.cache.calibration import FILE_NAME, Calibration, Curve, fit, load
from metainfer_gen.video.cache.config import PRESET_MIN_INFERENCE_STEPS
from metainfer_gen.video.cache.stats import StepCacheStats, StepRecord

CALL = dict(num_frames=5, height=32, width=32, guidance_scale=5.0)


def _record(step: int, branch: str, signal, change, extra=None) -> StepRecord:
    return StepRecord(step, branch, "transformer", True, "over budget", signal, None, 0.1, False, change, extra)


def test_fit_averages_change_per_signal_by_step_and_the_curve_interpolates():
    runs = [StepCacheStats(num_inference_steps=5, steps=[
        _record(0, "cond", None, None), _record(1, "cond", 0.1, 0.2), _record(1, "uncond", 0.1, 0.4),
        _record(2, "cond", 0.2, 0.2, 0.1), _record(3, "cond", 0.5, 0.1, 0.05), _record(4, "cond", 0.1, 0.3, 0.1),
    ])]
    calibration = fit(runs, "input", {"transformer": "WanTransformer3DModel"})
    curve = calibration.curves["transformer"]
    assert curve.progress == (0.25, 0.5, 0.75, 1.0)
    assert curve.reuse_ratio == pytest.approx((3.0, 1.0, 0.2, 3.0))
    assert curve.extrapolation_ratio[0] is None and curve.extrapolation_ratio[1] == pytest.approx(0.5)
    assert calibration.ratios_at("transformer", 0.375)[0] == pytest.approx(2.0)  # halfway between 3.0 and 1.0
    assert calibration.ratios_at("transformer", 0.0)[0] == pytest.approx(3.0)  # clamped to the first point
    assert calibration.ratios_at("transformer_2", 0.5) is None
    with pytest.raises(ValueError, match="at least 3 steps"):
        fit([StepCacheStats(num_inference_steps=5, steps=[_record(0, "cond", None, None)])], "input", {})


def test_file_round_trips_and_bad_files_raise(tmp_path):
    calibration = Calibration("first_block", 10, 2, {"transformer": Curve("X", (0.1, 0.9), (1.0, 2.0), (None, 0.5))})
    path = calibration.save(tmp_path)
    assert path == tmp_path / FILE_NAME
    loaded = load(tmp_path)
    assert loaded == calibration and loaded.source == str(path)
    (tmp_path / "bad.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="format"):
        load(tmp_path / "bad.json")
    data = calibration.to_dict()
    data["models"]["transformer"]["progress"] = [0.9, 0.1]
    (tmp_path / "order.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="increase"):
        load(tmp_path / "order.json")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="signal"):
        StepCacheConfig(signal="input", calibration=calibration)


def test_calibrate_once_then_auto_finds_the_file_beside_the_model(tmp_path, tiny_wan_dir):
    from metainfer_gen.apps.cli import main
    from metainfer_gen.pipelines import TextToVideoPipeline

    model = tmp_path / "model"
    shutil.copytree(tiny_wan_dir, model)
    args = ["--num-frames", "5", "--height", "32", "--width", "32", "--steps", "6", "--prompt", "a red circle"]
    assert main(["calibrate", "--model", str(model), *args]) == 0
    calibration = load(model)
    curve = calibration.curves["transformer"]
    assert calibration.signal == "input" and calibration.num_inference_steps == 6
    assert len(curve.progress) == 5 and all(r > 0 for r in curve.reuse_ratio)  # steps 1..5 measured

    pipe = TextToVideoPipeline.from_pretrained(model, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_step_cache("auto=1000")  # a preset: it reuses from PRESET_MIN_INFERENCE_STEPS on
    out = pipe("a red circle moving right", num_inference_steps=PRESET_MIN_INFERENCE_STEPS, seed=0, **CALL)
    cache = out.stats.cache
    assert cache["ratios"] == str(model / FILE_NAME)
    assert cache["num_reused"] > 0
    assert "calibrating" not in {r["reason"] for r in cache["steps"]}  # the file's ratios serve from step 2 on
    pipe.disable_step_cache()
    pipe.enable_step_cache("fbcache")  # a baseline ignores the file
    pipe.disable_step_cache()
    with pytest.raises(ValueError, match="baseline"):
        pipe.enable_step_cache("fbcache", calibration=model / FILE_NAME)


def test_calibrate_refuses_to_write_into_the_embedded_model(capsys):
    from metainfer_gen.apps.cli import main

    assert main(["calibrate", "--steps", "4"]) == 2
    assert "--output" in capsys.readouterr().err
