"""A negative prompt acts only through classifier-free guidance: at ``guidance_scale <= 1`` the pipelines say so
(a warning) and record it as unused (``settings["negative_prompt"] is None``) instead of passing it silently."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline

PROMPT = "a red circle moving right"
NEGATIVE = "blurry, green"
SMALL = dict(num_frames=5, height=32, width=32, num_inference_steps=2, seed=0)


@pytest.fixture(scope="module", params=["t2v", "i2v"])
def render(request, tiny_wan_dir):
    """``render(**call)`` on the tiny text-to-video pipeline or the image-to-video one on the same weights."""
    t2v = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu")
    t2v.set_progress_bar_config(disable=True)
    if request.param == "t2v":
        return lambda **call: t2v(PROMPT, **SMALL, **call)
    i2v = ImageToVideoPipeline.from_pipe(t2v)
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    return lambda **call: i2v(image, PROMPT, **SMALL, **call)


@pytest.mark.parametrize("guidance_scale", [1.0, 0.5, 0])
def test_a_negative_prompt_without_guidance_warns_and_is_recorded_unused(render, guidance_scale):
    with pytest.warns(UserWarning, match=r"no effect at guidance_scale=.* <= 1.*raise guidance_scale above 1"):
        out = render(negative_prompt=NEGATIVE, guidance_scale=guidance_scale)
    assert out.settings["negative_prompt"] is None
    assert out.settings["guidance_scale"] == guidance_scale
    plain = render(guidance_scale=guidance_scale)
    np.testing.assert_array_equal(out.frames, plain.frames)  # it really had no effect


def test_a_negative_prompt_with_guidance_is_used_and_recorded_without_a_warning(render):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*negative_prompt.*")
        out = render(negative_prompt=NEGATIVE, guidance_scale=5.0)
    assert out.settings["negative_prompt"] == NEGATIVE
    assert not np.array_equal(out.frames, render(guidance_scale=5.0).frames)


@pytest.mark.parametrize("negative", [None, ""])
def test_no_negative_prompt_at_guidance_1_gives_no_warning(render, negative):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*negative_prompt.*")
        out = render(negative_prompt=negative, guidance_scale=1.0)
    assert not out.settings["negative_prompt"]


def test_a_negative_prompt_at_the_default_guidance_of_1_warns(tiny_wan_dir):
    from metainfer_gen.pipelines.video_base import VideoPipelineBase

    t2v = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu")
    t2v.set_progress_bar_config(disable=True)
    t2v.settings["guidance_scale"] = 1.0  # as a distilled model's settings file would
    assert isinstance(t2v, VideoPipelineBase) and t2v.default("guidance_scale") == 1.0
    with pytest.warns(UserWarning, match="no effect at guidance_scale=1.0"):
        out = t2v([PROMPT, PROMPT], negative_prompt=[NEGATIVE, NEGATIVE], **SMALL)
    assert all(o.settings["negative_prompt"] is None for o in out)
