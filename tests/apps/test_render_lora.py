"""LoRAs on the command line (``--lora path[:weight]``) and per prompt-file line (``"lora"``), with the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from metainfer_gen.apps.cli import main
from metainfer_gen.apps.render import MANIFEST, parse_lora_spec, parse_prompt_file
from metainfer_gen.video.export import read_video
from tests.apps.test_cli import PROMPT, small
from tests.video import lora_files


@pytest.fixture(scope="module")
def lora_file(tiny_wan_dir, tmp_path_factory) -> Path:
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel.from_pretrained(str(tiny_wan_dir), subfolder="transformer")
    return lora_files.write(lora_files.make_lora(transformer, scale=0.5), "kohya", tmp_path_factory.mktemp("lora"))


def test_lora_specs_parse_weights_and_resolve_paths(tmp_path, monkeypatch):
    (tmp_path / "style.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert parse_lora_spec("style.safetensors") == (str(tmp_path / "style.safetensors"), 1.0)
    assert parse_lora_spec("style.safetensors:0.25") == (str(tmp_path / "style.safetensors"), 0.25)
    assert parse_lora_spec(f"{tmp_path}/style.safetensors:-1") == (str(tmp_path / "style.safetensors"), -1.0)
    with pytest.raises(ValueError, match="must be a number"):
        parse_lora_spec("style.safetensors:strong")
    with pytest.raises(ValueError, match="finite"):
        parse_lora_spec("style.safetensors:nan")
    with pytest.raises(FileNotFoundError, match="missing.safetensors does not exist"):
        parse_lora_spec("missing.safetensors:0.5")


def test_prompt_file_lora_field_resolves_against_the_file_and_bad_ones_fail_their_line(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"")
    lines = [json.dumps({"prompt": "a red circle", "seed": 0, **extra}) for extra in (
        {}, {"lora": "a.safetensors:0.5"}, {"lora": []}, {"lora": ["gone.safetensors"]}, {"lora": 3})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    default = [(str(tmp_path / "a.safetensors"), 1.0)]
    plain, own, none, missing, wrong = parse_prompt_file(tmp_path / "p.jsonl", loras=default)
    assert plain.loras == default and own.loras == [(str(tmp_path / "a.safetensors"), 0.5)] and none.loras == []
    assert "line 4" in missing.error and "gone.safetensors does not exist" in missing.error
    assert "'lora' must be" in wrong.error
    assert len({plain.job_id, own.job_id, none.job_id}) == 3  # the LoRA is part of what makes the clip
    assert none.job_id == parse_prompt_file(tmp_path / "p.jsonl")[0].job_id  # no LoRA: the id of before


def test_cli_lora_flag_changes_the_clip_and_weight_zero_does_not(tmp_path, tiny_wan_dir, lora_file, capsys):
    clips = {}
    for label, extra in (("base", []), ("zero", ["--lora", f"{lora_file}:0"]), ("full", ["--lora", str(lora_file)])):
        assert main(["render", PROMPT, "-o", str(tmp_path / f"{label}.mp4"), *small(tiny_wan_dir), *extra]) == 0
        clips[label] = read_video(tmp_path / f"{label}.mp4")
    assert "8 modules adapted" in capsys.readouterr().out
    np.testing.assert_array_equal(clips["zero"], clips["base"])
    assert np.abs(clips["full"].astype(int) - clips["base"]).mean() > 1.0


def test_cli_missing_lora_exits_2_before_loading_the_model(tmp_path, monkeypatch, capsys):
    from metainfer_gen.pipelines import TextToVideoPipeline

    monkeypatch.setattr(TextToVideoPipeline, "from_pretrained", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["render", PROMPT, "-o", str(tmp_path / "c.mp4"), "--lora", str(tmp_path / "no.safetensors")]) == 2
    assert "no.safetensors does not exist" in capsys.readouterr().err


def test_batch_swaps_loras_per_line_on_one_model_and_the_manifest_records_them(tmp_path, tiny_wan_dir, lora_file,
                                                                               monkeypatch):
    from metainfer_gen.video import lora

    reads = []
    original = lora.read_lora_file
    monkeypatch.setattr(lora, "read_lora_file", lambda path: reads.append(path) or original(path))
    lines = [json.dumps({"prompt": PROMPT, "seed": 0, "lora": f"{lora_file}:1.0"}),
             json.dumps({"prompt": PROMPT, "seed": 0, "lora": []}),
             json.dumps({"prompt": PROMPT, "seed": 0}),  # the --lora default: weight 0
             json.dumps({"prompt": PROMPT, "seed": 0, "lora": [f"{lora_file}:1"], "name": "again"})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "clips"
    assert main(["render", "--prompts", str(tmp_path / "p.jsonl"), "--out-dir", str(out), "--lora", f"{lora_file}:0",
                 *small(tiny_wan_dir)]) == 0
    records = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    assert [r["status"] for r in records] == ["ok"] * 4
    assert records[0]["loras"] == [{"path": str(lora_file), "weight": 1.0, "adapter": "kohya", "modules": 8,
                                    "skipped": 0}]
    assert "loras" not in records[1] and records[2]["loras"][0]["weight"] == 0.0
    frames = [read_video(out / r["path"]) for r in records]
    np.testing.assert_array_equal(frames[1], frames[2])  # weight 0 is the base model
    np.testing.assert_array_equal(frames[0], frames[3])  # swapped out and back in: the same clip
    assert not np.array_equal(frames[0], frames[1])
    assert len(reads) == 1  # the file was read once: later lines only changed weights
