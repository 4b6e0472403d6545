"""The demo's input bounds and LoRA-folder rule (plain Python: no model, no gradio)."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from metainfer_gen.apps.demo_limits import DemoLimits, InputError, list_loras, resolve_lora

OK_VIDEO = dict(num_frames=17, height=64, width=64, num_inference_steps=20, guidance_scale=4.0, seed=0)


def test_values_inside_the_limits_come_back_as_numbers():
    values = DemoLimits().check_video(**{**OK_VIDEO, "num_frames": 17.0, "seed": "3"})
    assert values == dict(num_frames=17, height=64, width=64, num_inference_steps=20, guidance_scale=4.0, seed=3)
    assert all(type(values[n]) is int for n in ("num_frames", "height", "width", "num_inference_steps", "seed"))


@pytest.mark.parametrize("name, value, words", [
    ("num_frames", 34, "num_frames=34 is outside this demo's range 1..33"),
    ("num_frames", 0, "range 1..33"),
    ("height", 512, "height=512 is outside this demo's range 1..256"),
    ("width", 272, "width=272 is outside"),
    ("num_inference_steps", 51, "num_inference_steps=51 is outside this demo's range 1..50"),
    ("guidance_scale", 31, "guidance_scale=31 is outside this demo's range 0..30"),
    ("guidance_scale", float("nan"), "guidance_scale=nan"),
    ("guidance_scale", "lots", "guidance_scale must be a number"),
    ("seed", -1, "seed=-1 must be in 0..2**63-1"),
    ("num_frames", 16.5, "num_frames must be a whole number; got 16.5"),
    ("height", None, "height must be a whole number; got None"),
    ("num_inference_steps", True, "must be a whole number; got True"),
])
def test_video_values_outside_the_limits_are_refused_naming_the_range(name, value, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace("*", r"\*").replace(".", r"\.")):
        DemoLimits().check_video(**{**OK_VIDEO, name: value})


def test_limits_follow_the_configuration():
    limits = DemoLimits(max_frames=9, max_size=32, max_steps=4)
    with pytest.raises(InputError, match="num_frames=17 is outside this demo's range 1..9"):
        limits.check_video(**OK_VIDEO)
    assert limits.check_video(**{**OK_VIDEO, "num_frames": 9, "height": 32, "width": 32,
                                 "num_inference_steps": 4})["num_frames"] == 9


def test_prompts_are_required_bounded_and_stripped():
    limits = DemoLimits(max_prompt_chars=10)
    assert limits.check_prompt("  a cat  ") == "a cat"
    assert limits.check_prompt(None, "negative prompt", required=False) == ""
    with pytest.raises(InputError, match="prompt is empty"):
        limits.check_prompt("   ")
    with pytest.raises(InputError, match="prompt is 11 characters; this demo allows at most 10"):
        limits.check_prompt("x" * 11)
    with pytest.raises(InputError, match="negative prompt is 12 characters"):
        limits.check_prompt("y" * 12, "negative prompt", required=False)
    with pytest.raises(InputError, match="prompt must be text; got int"):
        limits.check_prompt(5)


def test_images_need_to_exist_and_fit_the_pixel_budget():
    limits = DemoLimits(max_image_pixels=100 * 100)
    limits.check_image(Image.new("RGBA", (100, 100)))
    with pytest.raises(InputError, match="upload a reference image first"):
        limits.check_image(None)
    with pytest.raises(InputError, match=r"101x100 \(10,100 pixels\); this demo accepts at most 10,000 pixels"):
        limits.check_image(Image.new("L", (101, 100)))
    with pytest.raises(InputError, match="must be a picture; got str"):
        limits.check_image("/etc/passwd")


def test_llm_requests_are_bounded():
    limits = DemoLimits(max_new_tokens=32)
    assert limits.check_text_request(max_new_tokens=32.0, temperature="0.7") == (32, 0.7)
    with pytest.raises(InputError, match="max_new_tokens=33 is outside this demo's range 1..32"):
        limits.check_text_request(max_new_tokens=33, temperature=0)
    with pytest.raises(InputError, match="temperature=2.5 is outside this demo's range 0..2"):
        limits.check_text_request(max_new_tokens=8, temperature=2.5)


@pytest.mark.parametrize("field", ["max_frames", "max_size", "max_queue"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_limits_are_refused_at_construction(field, bad):
    with pytest.raises(ValueError, match=f"DemoLimits.{field} must be an int >= 1"):
        DemoLimits(**{field: bad})


# ------------------------------------------------------------------------------------------------- LoRA folder


@pytest.fixture()
def lora_folder(tmp_path):
    folder = tmp_path / "loras"
    (folder / "styles").mkdir(parents=True)
    (folder / "anime.safetensors").write_bytes(b"x")
    (folder / "styles" / "ink.safetensors").write_bytes(b"x")
    (folder / "notes.txt").write_text("not a LoRA")
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"x")
    os.symlink(outside, folder / "escape.safetensors")  # a link that leaves the folder
    return folder


def test_lora_list_holds_only_weight_files_inside_the_folder(lora_folder):
    assert list_loras(lora_folder) == ["anime.safetensors", "styles/ink.safetensors"]
    assert list_loras(None) == []
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        list_loras(lora_folder / "anime.safetensors")


def test_a_listed_lora_resolves_to_its_file(lora_folder):
    assert resolve_lora(lora_folder, "styles/ink.safetensors") == (lora_folder / "styles" / "ink.safetensors").resolve()


@pytest.mark.parametrize("name, words", [
    ("../secret.safetensors", "outside the LoRA folder"),
    ("styles/../../secret.safetensors", "outside the LoRA folder"),
    ("escape.safetensors", "outside the LoRA folder"),
    ("/etc/passwd", "not a path"),
    ("..\\secret.safetensors", "not a path"),
    ("notes.txt", "only .safetensors, .bin files are LoRA weights"),
    ("missing.safetensors", "does not exist in the LoRA folder"),
    ("", "choose a LoRA from the list"),
])
def test_a_path_outside_the_lora_folder_is_refused(lora_folder, name, words):
    with pytest.raises(InputError, match=words):
        resolve_lora(lora_folder, name)
