"""Fixtures of the video tests: fresh tiny pipelines for the step-cache tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def fresh_t2v(tiny_wan_dir):
    """A newly loaded tiny text-to-video pipeline (function scope: cache hooks never leak between tests), without
    the default embed memo, so the tests that count embedder runs or hooks start from the bare model."""
    from metainfer_gen.pipelines import TextToVideoPipeline

    pipe = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu", embed_memo=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def fresh_i2v(tiny_wan_i2v_dir):
    """A newly loaded tiny Wan 2.1-style image-to-video pipeline (function scope)."""
    from metainfer_gen.pipelines import ImageToVideoPipeline

    pipe = ImageToVideoPipeline.from_pretrained(tiny_wan_i2v_dir, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe
