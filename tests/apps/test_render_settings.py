"""The batch manifest records the settings a clip was really rendered with, and the warnings its call raised."""

from __future__ import annotations

import json

import pytest

from metainfer_gen.apps.render import MANIFEST, parse_prompt_file, render_batch

SMALL = {"num_inference_steps": 2, "num_frames": 5, "height": 32, "width": 32}


@pytest.fixture(scope="module")
def t2v(tiny_wan_dir):
    from metainfer_gen.pipelines import TextToVideoPipeline

    pipe = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_an_unused_negative_prompt_is_recorded_null_with_the_warning(tmp_path, t2v, capsys):
    lines = ['{"prompt": "a red circle", "negative_prompt": "blurry", "guidance_scale": 1.0}',
             '{"prompt": "a blue square", "negative_prompt": "blurry", "guidance_scale": 5.0}']
    (tmp_path / "prompts.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    jobs = parse_prompt_file(tmp_path / "prompts.txt", defaults=SMALL)

    summary = render_batch(jobs, tmp_path / "out", lambda task: t2v, progress=False)

    assert summary.rendered == 2
    unguided, guided = [json.loads(line) for line in (tmp_path / "out" / MANIFEST).read_text().splitlines()]
    assert unguided["status"] == "ok" and unguided["settings"]["guidance_scale"] == 1.0
    assert unguided["settings"]["negative_prompt"] is None
    assert len(unguided["warnings"]) == 1 and "negative_prompt" in unguided["warnings"][0]
    assert guided["settings"]["negative_prompt"] == "blurry" and "warnings" not in guided
    err = capsys.readouterr().err  # said on the terminal too, with the prompt file's line
    assert "line 1: warning: negative_prompt has no effect at guidance_scale=1.0" in err and "line 2" not in err


def test_other_warnings_of_a_job_pass_on_unrecorded(tmp_path):
    (tmp_path / "prompts.txt").write_text("a red circle\n", encoding="utf-8")
    jobs = parse_prompt_file(tmp_path / "prompts.txt")

    class Output:
        settings: dict = {}

        class stats:  # noqa: N801 - stands in for GenerationStats
            @staticmethod
            def to_dict():
                return {}

        def save(self, path, fps=None):
            path.write_bytes(b"clip")

    def pipe(prompt, **kwargs):
        import warnings

        warnings.warn("old argument", DeprecationWarning, stacklevel=1)
        return Output()

    with pytest.warns(DeprecationWarning, match="old argument"):
        render_batch(jobs, tmp_path / "out", lambda task: pipe, progress=False)
    record = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert record["status"] == "ok" and "warnings" not in record
