"""``metainfer_gen.video.rules.VideoRules``: inputs refused up front with the rule and the nearest valid values."""

from __future__ import annotations

import math
import re

import pytest

from metainfer_gen.video.rules import VideoRules

# The rule text may be written k*4+1, 4k+1, 4*k + 1...
WAN_FRAME_RULE = re.compile(r"k\s*\*?\s*4\s*\+\s*1|4\s*\*?\s*k\s*\+\s*1")


@pytest.fixture
def wan() -> VideoRules:
    return VideoRules(family="WanPipeline", temporal_factor=4, spatial_multiple=16)


def valid(**overrides):
    values = dict(num_frames=17, height=32, width=48, num_inference_steps=2, guidance_scale=5.0,
                  prompt="a red circle moving right")
    values.update(overrides)
    return values


@pytest.mark.parametrize("num_frames", [1, 5, 9, 17, 81])
def test_wan_frame_counts_of_the_form_4k_plus_1_pass(wan, num_frames):
    assert wan.check(**valid(num_frames=num_frames)) is None


def test_zero_frames_raises_naming_the_rule(wan):
    with pytest.raises(ValueError, match="num_frames=0") as info:
        wan.check(**valid(num_frames=0))
    message = str(info.value)
    assert WAN_FRAME_RULE.search(message), message
    assert re.search(r"\buse 1\b", message), message


def test_negative_frames_raise(wan):
    with pytest.raises(ValueError, match="num_frames=-3"):
        wan.check(**valid(num_frames=-3))


@pytest.mark.parametrize("num_frames, nearest", [(15, ("13", "17")), (16, ("17",)), (14, ("13",)), (2, ("1", "5"))])
def test_frame_counts_off_the_grid_raise_naming_rule_and_nearest_counts(wan, num_frames, nearest):
    with pytest.raises(ValueError, match=f"num_frames={num_frames}") as info:
        wan.check(**valid(num_frames=num_frames))
    message = str(info.value)
    assert "WanPipeline" in message
    assert WAN_FRAME_RULE.search(message), message
    for count in nearest:
        assert re.search(rf"\b{count}\b", message.split("use")[-1]), f"{count} missing from {message!r}"


def test_any_frame_count_passes_without_temporal_compression():
    rules = VideoRules(family="SomeImagePipeline", temporal_factor=1, spatial_multiple=8)
    for num_frames in (1, 2, 15, 16):
        assert rules.check(**valid(num_frames=num_frames, height=40, width=24)) is None
    with pytest.raises(ValueError, match="num_frames=0"):
        rules.check(**valid(num_frames=0, height=40, width=24))


@pytest.mark.parametrize("name", ["height", "width"])
def test_size_off_the_grid_raises_naming_the_multiple_and_nearest_sizes(wan, name):
    with pytest.raises(ValueError, match=f"{name}=481") as info:
        wan.check(**valid(**{name: 481}))
    message = str(info.value)
    assert re.search(r"\bmultiple of 16\b", message), message
    assert re.search(r"\b480\b", message) and re.search(r"\b496\b", message), message


@pytest.mark.parametrize("size", [0, 8, -16])
def test_sizes_below_one_grid_cell_raise(wan, size):
    with pytest.raises(ValueError, match=f"height={size}") as info:
        wan.check(**valid(height=size))
    assert re.search(r"\b16\b", str(info.value))


@pytest.mark.parametrize("name", ["num_frames", "height", "width", "num_inference_steps"])
@pytest.mark.parametrize("bad", [32.0, "32", True, None])
def test_non_int_counts_and_sizes_raise_type_error(wan, name, bad):
    with pytest.raises(TypeError, match=name):
        wan.check(**valid(**{name: bad}))


@pytest.mark.parametrize("steps", [0, -1])
def test_steps_below_one_raise(wan, steps):
    with pytest.raises(ValueError, match="num_inference_steps"):
        wan.check(**valid(num_inference_steps=steps))


@pytest.mark.parametrize("guidance", [0, 0.0, 1.0, 5, 7.5])
def test_guidance_scales_that_pass(wan, guidance):
    assert wan.check(**valid(guidance_scale=guidance)) is None


@pytest.mark.parametrize("guidance", [-1.0, math.nan, math.inf, -math.inf, "5", None, True])
def test_bad_guidance_scales_raise(wan, guidance):
    with pytest.raises(ValueError, match="guidance_scale"):
        wan.check(**valid(guidance_scale=guidance))


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t", None, [""], ["a red circle", " "], [None]])
def test_empty_prompts_raise(wan, prompt):
    with pytest.raises(ValueError, match="prompt"):
        wan.check(**valid(prompt=prompt))


def test_prompt_lists_pass_when_every_prompt_is_text(wan):
    assert wan.check(**valid(prompt=["a red circle", "a blue square"])) is None


def test_overlong_prompt_raises(wan):
    with pytest.raises(ValueError, match="prompt"):
        wan.check(**valid(prompt="word " * 5000))


def test_frame_rule_is_checked_with_keyword_arguments_only(wan):
    with pytest.raises(TypeError):
        wan.check(17, 32, 32, 2, 5.0, "a prompt")  # positional use would silently swap sizes


def test_rules_are_immutable(wan):
    with pytest.raises(AttributeError):
        wan.temporal_factor = 8


def test_a_wan_folder_gives_the_loaded_pipeline_rules_without_loading(tiny_wan_dir, tmp_path):
    from metainfer_gen.pipelines import TextToVideoPipeline
    from metainfer_gen.pipelines.loading import default_model_path

    for folder in (tiny_wan_dir, default_model_path()):
        loaded = TextToVideoPipeline.from_pretrained(folder, device="cpu").rules
        assert VideoRules.from_model_dir(folder) == loaded, folder
    assert VideoRules.from_model_dir(tmp_path / "missing") is None  # a hub id or no folder: read after loading
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model_index.json").write_text('{"_class_name": "LTXPipeline"}')
    assert VideoRules.from_model_dir(tmp_path / "other") is None  # another family: its own config keys


def test_check_sizes_checks_only_the_values_given(wan):
    assert wan.check_sizes() is None
    assert wan.check_sizes(height=32) is None
    with pytest.raises(ValueError, match=WAN_FRAME_RULE):
        wan.check_sizes(num_frames=16)
    with pytest.raises(ValueError, match="width=50 is not valid for WanPipeline: it must be a positive multiple of 16"):
        wan.check_sizes(num_frames=17, width=50)
