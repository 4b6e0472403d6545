"""``metainfer_gen.apps.render``: prompt-file parsing, the manifest, and resumable batch rendering.

Parsing tests need no model. Batch tests drive a real tiny Wan pipeline (``tests/conftest.py``) at 2 steps,
5 frames, 32x32, and count which prompts reach it, so "skipped" means "the pipeline never ran for it".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from metainfer_gen.apps.render import MANIFEST, parse_prompt_file, render_batch
from metainfer_gen.video.export import read_video
from tests.video.mp4_inspect import ffmpeg_stream_info, mp4_top_level_atoms

SMALL = {"num_inference_steps": 2, "num_frames": 5, "height": 32, "width": 32}


def write_prompts(folder: Path, lines: list[str], name: str = "prompts.txt") -> Path:
    path = folder / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_image(path: Path, seed: int = 0) -> Path:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def read_manifest(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / MANIFEST).read_text(encoding="utf-8").splitlines()]


# ----------------------------------------------------------------------------------------------- parse_prompt_file


def test_plain_and_json_lines_parse_into_jobs(tmp_path):
    path = write_prompts(tmp_path, [
        "a red circle moving right",
        json.dumps({"prompt": "a blue square", "seed": 42, "num_frames": 9, "height": 48, "width": 64,
                    "image": "ref.png", "name": "Intro Shot!", "negative_prompt": "blurry",
                    "num_inference_steps": 3, "guidance_scale": 1.0}),
    ])

    plain, full = parse_prompt_file(path, base_seed=10)

    assert (plain.line, plain.prompt, plain.seed, plain.image, plain.call, plain.error) == \
        (1, "a red circle moving right", 10, None, {}, None)
    assert (full.line, full.prompt, full.seed, full.error) == (2, "a blue square", 42, None)
    assert full.image == str(tmp_path / "ref.png")
    assert full.call == {"num_frames": 9, "height": 48, "width": 64, "negative_prompt": "blurry",
                         "num_inference_steps": 3, "guidance_scale": 1.0}
    # Output names: job index, slug of `name` (else of the prompt), job id.
    assert plain.name == f"0000-a-red-circle-moving-right-{plain.job_id}"
    assert full.name == f"0001-intro-shot-{full.job_id}"


def test_comments_and_blank_lines_are_skipped_and_line_numbers_kept(tmp_path):
    path = write_prompts(tmp_path, ["# header", "", "first", "   ", "  # indented comment", "second", "#"])

    jobs = parse_prompt_file(path)

    assert [(j.line, j.prompt) for j in jobs] == [(3, "first"), (6, "second")]


def test_default_seed_is_base_seed_plus_job_index_and_explicit_seeds_win(tmp_path):
    path = write_prompts(tmp_path, [
        "zero", "# comment does not count", '{"prompt": "one", "seed": 7}', '{"prompt": "bad", "colour": 1}',
        "three", '{"prompt": "four", "seed": 0}',
    ])

    jobs = parse_prompt_file(path, base_seed=100)

    # Bad lines are jobs too, so they take an index.
    assert [j.seed for j in jobs] == [100, 7, 102, 103, 0]


def test_cli_defaults_apply_to_every_line_unless_the_line_overrides(tmp_path):
    path = write_prompts(tmp_path, ["plain", '{"prompt": "own frames", "num_frames": 9}'])

    plain, own = parse_prompt_file(path, defaults={"num_frames": 5, "num_inference_steps": 2})

    assert plain.call == {"num_frames": 5, "num_inference_steps": 2}
    assert own.call == {"num_frames": 9, "num_inference_steps": 2}


def test_image_paths_resolve_against_the_prompt_file_folder(tmp_path, monkeypatch):
    folder = tmp_path / "batch"
    (folder / "refs").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = write_prompts(folder, [
        '{"prompt": "relative", "image": "refs/a.png"}',
        json.dumps({"prompt": "absolute", "image": str(elsewhere / "b.png")}),
    ])

    monkeypatch.chdir(elsewhere)  # not the prompt file's folder
    relative, absolute = parse_prompt_file(path)

    assert relative.image == str(folder / "refs" / "a.png")
    assert absolute.image == str(elsewhere / "b.png")


def test_job_ids_do_not_depend_on_the_working_directory_or_how_the_file_is_named(tmp_path, monkeypatch):
    path = write_prompts(tmp_path, ['{"prompt": "animate", "image": "ref.png", "seed": 1}', "text only"])
    by_absolute = [j.job_id for j in parse_prompt_file(path)]

    monkeypatch.chdir(tmp_path)
    by_relative = [j.job_id for j in parse_prompt_file("prompts.txt")]
    by_dotted = [j.job_id for j in parse_prompt_file("./prompts.txt")]

    assert by_absolute == by_relative == by_dotted


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "unclosed"', "line 2: Expecting"),
    ('["a list", "is not an object"]', "line 2: a JSON line must be an object"),
    ('{"prompt": ""}', "line 2: missing or empty 'prompt'"),
    ('{"prompt": "   "}', "line 2: missing or empty 'prompt'"),
    ('{"seed": 3}', "line 2: missing or empty 'prompt'"),
    ('{"prompt": 5}', "line 2: missing or empty 'prompt'"),
    ('{"prompt": "ok", "colour": "red"}', "line 2: unknown keys ['colour']"),
    ('{"prompt": "ok", "seed": "3"}', "line 2: 'seed' must be an integer; got '3'"),
    ('{"prompt": "ok", "seed": 1.5}', "line 2: 'seed' must be an integer; got 1.5"),
    ('{"prompt": "ok", "seed": true}', "line 2: 'seed' must be an integer; got True"),
])
def test_a_bad_line_becomes_a_job_with_an_error_naming_its_line(tmp_path, line, message):
    path = write_prompts(tmp_path, ["good before", line, "good after"])

    before, bad, after = parse_prompt_file(path)

    assert bad.line == 2
    assert bad.error is not None and bad.error.startswith(message), bad.error
    assert (before.error, after.error) == (None, None)
    assert (before.prompt, after.prompt) == ("good before", "good after")
    assert bad.name.startswith("0001-")


def test_job_ids_are_stable_and_independent_of_line_position(tmp_path):
    lines = ['{"prompt": "a red circle", "seed": 5}', '{"prompt": "a blue square", "seed": 9, "num_frames": 9}']
    first = parse_prompt_file(write_prompts(tmp_path, lines, "a.txt"))
    again = parse_prompt_file(tmp_path / "a.txt")
    moved = parse_prompt_file(write_prompts(tmp_path, ["# new header", "", lines[1], "# note", lines[0]], "b.txt"))

    assert [j.job_id for j in first] == [j.job_id for j in again]
    assert len({j.job_id for j in first}) == 2
    assert {j.prompt: j.job_id for j in first} == {j.prompt: j.job_id for j in moved}
    assert [j.line for j in moved] == [3, 5]


def test_job_ids_change_with_anything_that_changes_the_clip(tmp_path):
    base = parse_prompt_file(write_prompts(tmp_path, ['{"prompt": "p", "seed": 1}'], "base.txt"))[0].job_id
    variants = ['{"prompt": "q", "seed": 1}', '{"prompt": "p", "seed": 2}',
                '{"prompt": "p", "seed": 1, "num_frames": 9}', '{"prompt": "p", "seed": 1, "image": "x.png"}']
    ids = {parse_prompt_file(write_prompts(tmp_path, [v], f"v{i}.txt"))[0].job_id for i, v in enumerate(variants)}
    steps = parse_prompt_file(tmp_path / "base.txt", defaults={"num_inference_steps": 3})[0].job_id

    assert base not in ids and len(ids) == len(variants)
    assert steps != base


def test_a_missing_prompt_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        parse_prompt_file(tmp_path / "nope.txt")


# ----------------------------------------------------------------------------------------------------- render_batch


@pytest.fixture(scope="module")
def tiny_pipes(tiny_wan_dir):
    """Text-to-video and image-to-video sharing one set of tiny weights, progress bars off."""
    from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline

    t2v = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu")
    t2v.set_progress_bar_config(disable=True)
    i2v = ImageToVideoPipeline.from_pipe(t2v)
    i2v.set_progress_bar_config(disable=True)
    return {"text-to-video": t2v, "image-to-video": i2v}


class Pipelines:
    """``get_pipeline(task)`` over the real tiny pipelines that records every prompt it renders.

    ``fail_prompts``: prompts whose pipeline call raises (a clip failing inside the pipeline).
    ``fail_tasks``: tasks for which ``get_pipeline`` itself raises (e.g. a checkpoint that cannot do I2V).
    """

    def __init__(self, pipes, fail_prompts=(), fail_tasks=()):
        self.pipes, self.fail_prompts, self.fail_tasks = pipes, set(fail_prompts), set(fail_tasks)
        self.rendered: list[str] = []

    def __call__(self, task: str):
        if task in self.fail_tasks:
            raise ValueError(f"no {task} pipeline here")
        pipe = self.pipes[task]

        def call(*args, **kwargs):
            prompt = args[-1]  # (prompt,) for T2V, (image, prompt) for I2V
            self.rendered.append(prompt)
            if prompt in self.fail_prompts:
                raise RuntimeError(f"simulated failure for {prompt!r}")
            return pipe(*args, **kwargs)

        return call


def clip_facts(out_dir: Path) -> dict[str, tuple[int, int]]:
    """File name -> (mtime_ns, inode) of every clip in ``out_dir``: unchanged means not rewritten."""
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in out_dir.iterdir() if p.name != MANIFEST}


def test_batch_renders_every_good_line_and_records_every_job_in_order(tmp_path, tiny_pipes, capsys):
    write_image(tmp_path / "ref.png")
    path = write_prompts(tmp_path, [
        "# a small batch",
        "a red circle moving right",
        '{"prompt": "a blue square", "seed": 7, "num_frames": 9, "name": "square"}',
        '{"prompt": "the square moves up", "image": "ref.png"}',
        '{"prompt": "bad line", "colour": "red"}',
        '{"prompt": "no such image", "image": "missing.png"}',
        "a green triangle",
    ])
    jobs = parse_prompt_file(path, base_seed=3, defaults=SMALL)
    out = tmp_path / "clips"
    pipes = Pipelines(tiny_pipes)

    summary = render_batch(jobs, out, pipes, progress=False)

    assert (summary.rendered, summary.skipped, summary.failed) == (4, 0, 2)
    assert summary.manifest == str(out / MANIFEST)
    failures = [line for line in capsys.readouterr().err.splitlines() if " failed: " in line]
    assert [f.split(" failed: ")[0] for f in failures] == ["line 5", "line 6"]  # why, on the terminal as well
    # The bad line never reaches the pipeline; the missing image fails inside it.
    assert pipes.rendered == ["a red circle moving right", "a blue square", "the square moves up", "no such image",
                              "a green triangle"]
    records = read_manifest(out)
    assert [r["job_id"] for r in records] == [j.job_id for j in jobs]
    assert [r["line"] for r in records] == [2, 3, 4, 5, 6, 7]
    assert [r["status"] for r in records] == ["ok", "ok", "ok", "error", "error", "ok"]
    for job, record in zip(jobs, records):
        # The line that did not parse (line 5) has no seed; the missing image (line 6) failed with its own.
        seed = None if record["line"] == 5 else job.seed
        assert (record["prompt"], record["seed"], record["image"]) == (job.prompt, seed, job.image)
        assert isinstance(record["seconds"], float) and record["seconds"] >= 0
        if record["status"] == "ok":
            assert record["path"] == job.name + ".mp4"
            assert "error" not in record
            settings, stats = record["settings"], record["stats"]
            assert (settings["prompt"], settings["seed"], settings["height"], settings["width"]) == \
                (job.prompt, job.seed, 32, 32)
            assert settings["num_frames"] == job.call["num_frames"]
            assert settings["task"] == ("image-to-video" if job.image else "text-to-video")
            assert stats["num_inference_steps"] == 2
            assert stats["transformer_calls"] == 4  # 2 steps x 2 CFG branches
            assert stats["seconds"] > 0
            clip = out / record["path"]
            assert mp4_top_level_atoms(clip.read_bytes())[0] == "ftyp"
            info = ffmpeg_stream_info(clip)
            assert (info["codec"], info["width"], info["height"], info["frames"]) == \
                ("h264", 32, 32, settings["num_frames"])
        else:
            assert "stats" not in record
            assert record["path"] is None and not (out / (job.name + ".mp4")).exists()  # no clip, none named
    assert records[3]["error"].startswith("ValueError: line 5: unknown keys ['colour']; allowed: ")
    assert records[4]["error"].startswith("FileNotFoundError: image file ")
    assert "missing.png" in records[4]["error"]
    assert records[1]["settings"]["num_frames"] == 9 and records[0]["settings"]["num_frames"] == 5
    assert records[2]["settings"]["image_size"] == [32, 32]
    # Only the clips and the manifest: no temporaries left behind.
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST] + [r["path"] for r in records
                                                                         if r["status"] == "ok"])


def test_rerun_skips_finished_clips_and_retries_failed_ones(tmp_path, tiny_pipes):
    path = write_prompts(tmp_path, ["first clip", "flaky clip", '{"prompt": "bad", "seed": "x"}', "last clip"])
    jobs = parse_prompt_file(path, defaults=SMALL)
    out = tmp_path / "clips"

    first = render_batch(jobs, out, Pipelines(tiny_pipes, fail_prompts={"flaky clip"}), progress=False)
    records_before = read_manifest(out)
    clips_before = clip_facts(out)

    assert (first.rendered, first.skipped, first.failed) == (2, 0, 2)
    assert [r["status"] for r in records_before] == ["ok", "error", "error", "ok"]
    assert records_before[1]["error"] == "RuntimeError: simulated failure for 'flaky clip'"
    assert len(clips_before) == 2

    pipes = Pipelines(tiny_pipes)
    second = render_batch(parse_prompt_file(path, defaults=SMALL), out, pipes, progress=False)
    records_after = read_manifest(out)

    assert (second.rendered, second.skipped, second.failed) == (1, 2, 1)
    assert pipes.rendered == ["flaky clip"]  # finished clips never reach the pipeline again
    assert [r["status"] for r in records_after] == ["ok", "ok", "error", "ok"]
    assert records_after[0] == records_before[0] and records_after[3] == records_before[3]
    assert records_after[2]["error"] == records_before[2]["error"]
    after = clip_facts(out)
    assert {name: after[name] for name in clips_before} == clips_before  # same files, not rewritten
    assert ffmpeg_stream_info(out / records_after[1]["path"])["frames"] == 5


def test_a_clip_deleted_after_a_run_is_rendered_again(tmp_path, tiny_pipes):
    jobs = parse_prompt_file(write_prompts(tmp_path, ["keep me", "delete me"]), defaults=SMALL)
    out = tmp_path / "clips"
    render_batch(jobs, out, Pipelines(tiny_pipes), progress=False)
    kept, deleted = (out / r["path"] for r in read_manifest(out))
    kept_facts = clip_facts(out)[kept.name]
    deleted.unlink()

    pipes = Pipelines(tiny_pipes)
    summary = render_batch(jobs, out, pipes, progress=False)

    assert (summary.rendered, summary.skipped, summary.failed) == (1, 1, 0)
    assert pipes.rendered == ["delete me"]
    assert ffmpeg_stream_info(deleted)["frames"] == 5
    assert clip_facts(out)[kept.name] == kept_facts


def test_moving_lines_keeps_finished_clips(tmp_path, tiny_pipes):
    lines = ['{"prompt": "one", "seed": 1}', '{"prompt": "two", "seed": 2}']
    out = tmp_path / "clips"
    render_batch(parse_prompt_file(write_prompts(tmp_path, lines), defaults=SMALL), out, Pipelines(tiny_pipes),
                 progress=False)

    pipes = Pipelines(tiny_pipes)
    moved = parse_prompt_file(write_prompts(tmp_path, ["# reordered", lines[1], lines[0]]), defaults=SMALL)
    summary = render_batch(moved, out, pipes, progress=False)

    assert (summary.rendered, summary.skipped) == (0, 2)
    assert pipes.rendered == []
    # The manifest follows the new file order and line numbers.
    assert [(r["prompt"], r["line"]) for r in read_manifest(out)] == [("two", 2), ("one", 3)]


def test_get_pipeline_failing_for_a_task_is_recorded_and_the_batch_goes_on(tmp_path, tiny_pipes):
    write_image(tmp_path / "ref.png")
    path = write_prompts(tmp_path, ['{"prompt": "needs i2v", "image": "ref.png"}', "text is fine"])
    out = tmp_path / "clips"

    summary = render_batch(parse_prompt_file(path, defaults=SMALL), out,
                           Pipelines(tiny_pipes, fail_tasks={"image-to-video"}), progress=False)

    records = read_manifest(out)
    assert (summary.rendered, summary.failed) == (1, 1)
    assert [r["status"] for r in records] == ["error", "ok"]
    assert records[0]["error"] == "ValueError: no image-to-video pipeline here"
    assert ffmpeg_stream_info(out / records[1]["path"])["frames"] == 5


@pytest.mark.parametrize("fmt", ["gif", "png"])
def test_gif_and_png_formats(tmp_path, tiny_pipes, fmt):
    jobs = parse_prompt_file(write_prompts(tmp_path, ["a red circle", '{"prompt": "nine", "num_frames": 9}']),
                             defaults=SMALL)
    out = tmp_path / "clips"

    summary = render_batch(jobs, out, Pipelines(tiny_pipes), fmt=fmt, fps=12, progress=False)

    assert (summary.rendered, summary.failed) == (2, 0)
    records = read_manifest(out)
    for job, record, frames in zip(jobs, records, (5, 9)):
        clip = out / record["path"]
        if fmt == "gif":
            assert record["path"] == job.name + ".gif" and clip.is_file()
        else:
            assert record["path"] == job.name and clip.is_dir()
            assert sorted(p.name for p in clip.iterdir()) == [f"frame_{i:05d}.png" for i in range(frames)]
        video = read_video(clip)
        assert video.shape == (frames, 32, 32, 3) and video.dtype == np.uint8
        assert video.std() > 0  # real pictures, not a blank placeholder
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST] + [r["path"] for r in records])


def test_rerun_in_another_format_renders_instead_of_skipping(tmp_path, tiny_pipes):
    jobs = parse_prompt_file(write_prompts(tmp_path, ["a red circle"]), defaults=SMALL)
    out = tmp_path / "clips"
    render_batch(jobs, out, Pipelines(tiny_pipes), fmt="mp4", progress=False)

    pipes = Pipelines(tiny_pipes)
    summary = render_batch(jobs, out, pipes, fmt="gif", progress=False)

    assert (summary.rendered, summary.skipped) == (1, 0)
    assert pipes.rendered == ["a red circle"]
    assert read_manifest(out)[0]["path"] == jobs[0].name + ".gif"
    assert read_video(out / (jobs[0].name + ".gif")).shape == (5, 32, 32, 3)


def test_unknown_format_is_refused_before_any_work(tmp_path, tiny_pipes):
    pipes = Pipelines(tiny_pipes)
    with pytest.raises(ValueError, match="format must be one of"):
        render_batch(parse_prompt_file(write_prompts(tmp_path, ["x"])), tmp_path / "clips", pipes, fmt="webm",
                     progress=False)
    assert pipes.rendered == [] and not (tmp_path / "clips").exists()


def test_temporaries_of_a_killed_run_are_removed_and_other_files_kept(tmp_path, tiny_pipes):
    jobs = parse_prompt_file(write_prompts(tmp_path, ["a red circle"]), defaults=SMALL)
    out = tmp_path / "clips"
    out.mkdir()
    stale = [out / ".manifest.k2j3h4", out / f".{jobs[0].name}.x8y9z0.mp4", out / f".{jobs[0].name}.abc12"]
    stale[0].write_text('{"job_id": "partial')
    stale[1].write_bytes(b"\x00\x00\x00\x18ftypisom")  # a truncated MP4 header
    stale[2].mkdir()
    (stale[2] / "frame_00000.png").write_bytes(b"\x89PNG")
    unrelated = [out / ".hidden-user-file", out / "notes.txt"]
    for path in unrelated:
        path.write_text("keep")

    render_batch(jobs, out, Pipelines(tiny_pipes), progress=False)

    assert not any(p.exists() for p in stale)
    assert all(p.read_text() == "keep" for p in unrelated)
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, jobs[0].name + ".mp4"] +
                                                           [p.name for p in unrelated])


def test_manifest_keeps_records_of_other_prompt_files_and_honours_the_umask(tmp_path):
    out = tmp_path / "clips"
    # Bad lines only: recorded without any model.
    first = parse_prompt_file(write_prompts(tmp_path, ['{"prompt": "a", "colour": 1}'], "one.txt"))
    second = parse_prompt_file(write_prompts(tmp_path, ['{"seed": 1}', '["x"]'], "two.txt"))
    old = os.umask(0o022)
    try:
        render_batch(first, out, Pipelines({}), progress=False)
        summary = render_batch(second, out, Pipelines({}), progress=False)
    finally:
        os.umask(old)

    records = read_manifest(out)
    assert (summary.rendered, summary.failed) == (0, 2)
    assert [r["job_id"] for r in records] == [second[0].job_id, second[1].job_id, first[0].job_id]
    assert [r["status"] for r in records] == ["error"] * 3
    assert records[1]["error"] == "ValueError: line 2: a JSON line must be an object"
    assert (out / MANIFEST).stat().st_mode & 0o777 == 0o644
