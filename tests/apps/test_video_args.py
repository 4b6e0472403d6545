"""The model options shared by ``render`` and ``demo``: the lossless embed memo is on by default (as
``from_pretrained`` leaves it), off with ``--no-embed-memo`` (a model without Wan's condition embedder loads
without it: tests/pipelines/test_diffusers_conventions.py)."""

from __future__ import annotations

import argparse

from metainfer_gen import pipelines
from metainfer_gen.apps.video_args import add_video_model_arguments, apply_model_options


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_video_model_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_embed_memo_is_on_by_default_and_off_with_the_flag(tiny_wan_dir):
    pipe = pipelines.TextToVideoPipeline.from_pretrained(str(tiny_wan_dir))
    apply_model_options(pipe, _args())
    assert pipe.embed_memo_enabled
    other = pipelines.TextToVideoPipeline.from_pretrained(str(tiny_wan_dir))
    apply_model_options(other, _args("--no-embed-memo"))
    assert not other.embed_memo_enabled
