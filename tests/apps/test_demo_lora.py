"""The demo's LoRA control: offered only with a LoRA folder that holds files, by name only, swapped per request."""

from __future__ import annotations

import numpy as np
import pytest

from metainfer_gen.apps.demo_backend import DemoBackend
from metainfer_gen.apps.demo_limits import DemoLimits, InputError
from metainfer_gen.video.export import read_video
from tests.video import lora_files

SMALL = (5, 32, 32, 3, 1.0, 0)  # frames, height, width, steps, guidance, seed
PROMPT = "a red circle moving right"


@pytest.fixture(scope="module")
def lora_backend(tiny_wan_dir, tmp_path_factory):
    from metainfer_gen import pipelines

    t2v = pipelines.TextToVideoPipeline.from_pretrained(str(tiny_wan_dir), device="cpu")
    t2v.set_progress_bar_config(disable=True)
    folder = tmp_path_factory.mktemp("loras")
    lora_files.write(lora_files.make_lora(t2v.diffusers_pipeline.transformer, scale=0.5), "kohya", folder)
    return DemoBackend(t2v=t2v, i2v=None, llm=None, output_dir=tmp_path_factory.mktemp("clips"),
                       limits=DemoLimits(max_frames=9, max_size=64, max_steps=8), lora_dir=folder)


def clip(backend, lora="none", weight=1.0):
    return read_video(backend.text_to_video(PROMPT, "", *SMALL, "off", lora, weight).path)


def test_a_chosen_lora_changes_the_clip_and_none_restores_the_base(lora_backend):
    assert lora_backend.lora_choices() == ["none", "kohya.safetensors"]
    base = clip(lora_backend)
    styled = clip(lora_backend, "kohya.safetensors", 1.0)
    assert np.abs(styled.astype(int) - base).mean() > 1.0
    np.testing.assert_array_equal(clip(lora_backend), base)  # swapped out again, the model is the base
    np.testing.assert_array_equal(clip(lora_backend, "kohya.safetensors", 1.0), styled)


@pytest.mark.parametrize("name, weight, words", [
    ("../kohya.safetensors", 1.0, "outside the LoRA folder"),
    ("/etc/passwd", 1.0, "not a path"),
    ("kohya.safetensors", 5.0, "lora_weight \\(the LoRA.s weight\\) must be a number in \\[-2, 2\\]"),
    ("kohya.safetensors", float("nan"), "lora_weight \\(the LoRA.s weight\\) must be"),
])
def test_names_outside_the_folder_and_wild_weights_are_refused(lora_backend, name, weight, words):
    with pytest.raises(InputError, match=words):
        clip(lora_backend, name, weight)


def test_the_page_has_a_lora_control_only_when_there_is_a_lora(lora_backend, tmp_path):
    pytest.importorskip("gradio")
    from metainfer_gen.apps.gradio_app import build_app

    ids = {c["props"].get("elem_id") for c in build_app(lora_backend).get_config_file()["components"]}
    assert {i for i in ids if i and "lora" in i} == {"t2v-lora", "t2v-lora-weight"}  # on video tabs only
    folder, lora_backend.lora_dir = lora_backend.lora_dir, tmp_path  # an empty folder: nothing to choose
    try:
        ids = {c["props"].get("elem_id") for c in build_app(lora_backend).get_config_file()["components"]}
    finally:
        lora_backend.lora_dir = folder
    assert "t2v-lora" not in ids
