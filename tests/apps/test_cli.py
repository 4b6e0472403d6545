"""The ``metainfer-gen render`` command: single clips in-process, and a killed-and-resumed batch in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from metainfer_gen.apps.cli import main
from metainfer_gen.apps.render import MANIFEST
from metainfer_gen.video.export import read_video
from tests.video.mp4_inspect import ffmpeg_stream_info, mp4_top_level_atoms

REPO = Path(__file__).resolve().parents[2]
PROMPT = "a red circle moving right"


def small(model: Path, num_frames: int = 5) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--steps", "2", "--num-frames", str(num_frames),
            "--height", "32", "--width", "32"]


def write_image(path: Path, seed: int = 0) -> Path:
    from PIL import Image

    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
    return path


# ---------------------------------------------------------------------------------------------------- single clip


def test_render_writes_an_h264_clip_with_the_asked_frames(tmp_path, tiny_wan_dir, capsys):
    out = tmp_path / "c.mp4"

    code = main(["render", PROMPT, "-o", str(out), "--seed", "3", *small(tiny_wan_dir, num_frames=9)])

    assert code == 0
    assert mp4_top_level_atoms(out.read_bytes())[0] == "ftyp"
    info = ffmpeg_stream_info(out)
    assert (info["codec"], info["pix_fmt"], info["width"], info["height"], info["frames"]) == \
        ("h264", "yuv420p", 32, 32, 9)
    assert capsys.readouterr().out.startswith(f"wrote {out} (9 frames, 32x32)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.mp4"]  # no temporaries left


def test_vae_dtype_loads_the_vae_alone_in_bfloat16(tmp_path, tiny_wan_dir, monkeypatch):
    import torch

    from metainfer_gen.pipelines import TextToVideoPipeline

    dtypes = []
    original = TextToVideoPipeline.__call__

    def spy(self, *args, **kwargs):
        parts = self.diffusers_pipeline
        dtypes.append((parts.vae.dtype, parts.transformer.dtype))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TextToVideoPipeline, "__call__", spy)
    out = tmp_path / "c.mp4"
    assert main(["render", PROMPT, "-o", str(out), "--vae-dtype", "bfloat16", *small(tiny_wan_dir)]) == 0
    assert dtypes == [(torch.bfloat16, torch.float32)]
    assert ffmpeg_stream_info(out)["frames"] == 5


def test_image_flag_renders_image_to_video(tmp_path, tiny_wan_dir, monkeypatch):
    from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline

    calls = []
    original = ImageToVideoPipeline.__call__

    def spy(self, image, prompt, **kwargs):
        calls.append((image, prompt, kwargs["seed"], kwargs["num_frames"]))
        return original(self, image, prompt, **kwargs)

    monkeypatch.setattr(ImageToVideoPipeline, "__call__", spy)
    monkeypatch.setattr(TextToVideoPipeline, "__call__", lambda *a, **k: pytest.fail("text-to-video was used"))
    image = write_image(tmp_path / "first.png")
    out = tmp_path / "i2v.mp4"

    code = main(["render", "the square moves up", "--image", str(image), "-o", str(out), "--seed", "4",
                 *small(tiny_wan_dir)])

    assert code == 0
    assert calls == [(str(image), "the square moves up", 4, 5)]
    assert ffmpeg_stream_info(out)["frames"] == 5


def test_gif_output(tmp_path, tiny_wan_dir):
    out = tmp_path / "c.gif"

    assert main(["render", PROMPT, "-o", str(out), *small(tiny_wan_dir)]) == 0

    video = read_video(out)
    assert video.shape == (5, 32, 32, 3)
    assert out.read_bytes()[:6] in (b"GIF89a", b"GIF87a")


def test_invalid_num_frames_exits_2_with_the_rule_and_writes_nothing(tmp_path, tiny_wan_dir, capsys):
    code = main(["render", PROMPT, "-o", str(tmp_path / "c.mp4"), *small(tiny_wan_dir, num_frames=16)])

    err = capsys.readouterr().err
    assert code == 2
    assert "num_frames=16 is not valid" in err and "k*4+1" in err and "use 13 or 17" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [
    ["render", PROMPT, "--prompts", "prompts.txt"],
    ["render"],
])
def test_exactly_one_of_prompt_or_prompts_file(tmp_path, args, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("a prompt\n")

    code = main([*args, "--model", str(tmp_path / "no-model")])

    assert code == 2
    assert "give either a PROMPT or --prompts FILE (exactly one)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt"]


def test_missing_model_path_exits_2_with_a_clear_message(tmp_path, capsys):
    missing = tmp_path / "no-such-model"

    code = main(["render", PROMPT, "-o", str(tmp_path / "c.mp4"), "--model", str(missing), "--device", "cpu"])

    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"error: model path {missing} does not exist"
    assert list(tmp_path.iterdir()) == []


def test_missing_image_exits_2_before_loading_anything(tmp_path, capsys):
    code = main(["render", PROMPT, "--image", str(tmp_path / "nope.png"), "-o", str(tmp_path / "c.mp4"),
                 "--model", str(tmp_path / "no-model")])

    assert code == 2
    assert f"--image {tmp_path / 'nope.png'} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt_exits_2_before_loading_anything(tmp_path, capsys, prompt):
    code = main(["render", prompt, "-o", str(tmp_path / "c.mp4"), "--model", str(tmp_path / "no-model")])

    assert code == 2  # a missing model would say "model path ... does not exist": the prompt was checked first
    assert capsys.readouterr().err.strip() == f"error: prompt must be a non-empty string; got {prompt!r}"
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------------ batch mode


def test_batch_with_a_missing_model_records_the_load_error_for_every_clip(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    missing = tmp_path / "no-such-model"

    code = main(["render", "--prompts", str(prompts), "--out-dir", str(tmp_path / "clips"), "--model", str(missing),
                 "--device", "cpu"])

    assert code == 1
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["failed"] == 3
    records = [json.loads(line) for line in (tmp_path / "clips" / MANIFEST).read_text().splitlines()]
    # Every clip reports the real cause, not a leftover of the first failed load.
    assert [r["error"] for r in records] == [f"FileNotFoundError: model path {missing} does not exist"] * 3


def test_batch_of_text_and_image_lines_loads_the_weights_once(tmp_path, tiny_wan_dir, monkeypatch, capsys):
    from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline

    loads = []
    for cls in (TextToVideoPipeline, ImageToVideoPipeline):
        original = cls.from_pretrained.__func__

        def counting(klass, *args, _original=original, **kwargs):
            loads.append(klass.__name__)
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(counting))
    write_image(tmp_path / "ref.png")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a red circle\n{"prompt": "the circle moves", "image": "ref.png"}\n')

    code = main(["render", "--prompts", str(prompts), "--out-dir", str(tmp_path / "clips"), *small(tiny_wan_dir)])

    assert code == 0
    assert loads == ["TextToVideoPipeline"]  # image-to-video reuses the loaded weights
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {
        "rendered": 2, "skipped": 0, "failed": 0, "manifest": str(tmp_path / "clips" / MANIFEST)}


def _ok_records(manifest: Path) -> dict[str, dict]:
    if not manifest.exists():
        return {}
    records = [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines()]
    return {r["job_id"]: r for r in records if r["status"] == "ok"}


def test_batch_killed_half_way_resumes_without_rendering_anything_twice(tmp_path, tiny_wan_dir):
    """The issue's acceptance check: 20 lines (2 bad), SIGKILL after >= 5 clips, rerun to completion."""
    lines = [f"clip {i}: a red circle moving right" if i % 2 else
             json.dumps({"prompt": f"clip {i}: a blue square moving up", "seed": 100 + i}) for i in range(18)]
    lines.insert(4, '{"prompt": "bad seed", "seed": "four"}')
    lines.insert(13, '{"prompt": "bad key", "colour": "red"}')
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "clips"
    manifest = out / MANIFEST
    command = [sys.executable, "-m", "metainfer_gen.apps.cli", "render", "--prompts", str(prompts),
               "--out-dir", str(out), *small(tiny_wan_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

    # The log files take tqdm's output: a pipe nobody reads would block the child once full.
    with open(tmp_path / "first.log", "wb") as log:
        # Own session: SIGKILL the whole group, the ffmpeg encoder included, like a crash.
        first = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 600  # a liveness guard, generous for loaded machines (120 s failed at load 8)
            while len(_ok_records(manifest)) < 5:
                assert first.poll() is None, "the first run ended before it could be killed"
                assert time.monotonic() < deadline, "no 5 clips within 600 s"
                time.sleep(0.02)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == -signal.SIGKILL
    before = _ok_records(manifest)
    assert 5 <= len(before) < 18, f"{len(before)} clips done at the kill: nothing left to resume"
    before_files = {r["path"]: ((out / r["path"]).stat().st_mtime_ns, (out / r["path"]).stat().st_ino)
                    for r in before.values()}

    rerun = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=300)

    assert rerun.returncode == 1  # two clips failed
    summary = json.loads(rerun.stdout.decode().splitlines()[-1])
    assert (summary["rendered"], summary["skipped"], summary["failed"]) == (18 - len(before), len(before), 2)
    records = [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines()]
    assert [r["line"] for r in records] == list(range(1, 21))  # one record per job, in prompt-file order
    assert [r["status"] for r in records].count("ok") == 18
    errors = {r["line"]: r["error"] for r in records if r["status"] == "error"}
    assert sorted(errors) == [5, 14]
    assert all(r["path"] is None for r in records if r["status"] == "error")  # no file is named that was not written
    assert errors[5] == "ValueError: line 5: 'seed' must be an integer; got 'four'"
    assert errors[14].startswith("ValueError: line 14: unknown keys ['colour']")
    # Clips finished before the kill were not rendered again: same records, same files.
    assert {r["job_id"]: r for r in records if r["job_id"] in before} == before
    assert {p: ((out / p).stat().st_mtime_ns, (out / p).stat().st_ino) for p in before_files} == before_files
    # Nothing corrupt, partial or temporary in the folder: only the manifest and 18 complete clips.
    ok_paths = sorted(r["path"] for r in records if r["status"] == "ok")
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, *ok_paths])
    for name in ok_paths:
        assert mp4_top_level_atoms((out / name).read_bytes())[0] == "ftyp"
        info = ffmpeg_stream_info(out / name)
        assert (info["codec"], info["frames"], info["width"], info["height"]) == ("h264", 5, 32, 32)


def test_steps_also_go_by_their_diffusers_name():
    from metainfer_gen.apps.cli import build_parser

    parser = build_parser()
    for flag in ("--steps", "--num-inference-steps"):
        assert parser.parse_args(["render", "a prompt", flag, "7"]).num_inference_steps == 7
        assert parser.parse_args(["calibrate", "--model", "m", flag, "30"]).steps == 30


@pytest.mark.parametrize("fps", ["nan", "inf", "0", "-5"])
def test_a_bad_fps_is_refused_before_anything_renders(tmp_path, tiny_wan_dir, capsys, fps):
    with pytest.raises(SystemExit) as exit_info:
        main(["render", "x", "--model", str(tiny_wan_dir), "--fps", fps, "-o", str(tmp_path / "clip.mp4")])
    assert exit_info.value.code == 2
    assert "fps must be a finite number > 0" in capsys.readouterr().err
    assert not (tmp_path / "clip.mp4").exists()


@pytest.mark.parametrize("scale", ["-1", "nan", "inf"])
def test_a_bad_guidance_scale_is_refused_by_the_parser_before_the_model_loads(scale, capsys):
    from metainfer_gen.apps.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["render", "a prompt", "--guidance-scale", scale])
    assert exit_info.value.code == 2
    assert f"must be a finite number >= 0 (1 disables guidance); got {scale}" in capsys.readouterr().err
    assert build_parser().parse_args(["render", "a prompt", "--guidance-scale", "0"]).guidance_scale == 0.0
