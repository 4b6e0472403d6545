"""The model options shared by ``render`` and ``demo``: the lossless embed memo is on by default, off with
``--no-embed-memo``, and skipped on a model without Wan's condition embedder."""

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


def test_a_model_the_memo_does_not_fit_still_loads(tiny_wan_dir, monkeypatch):
    pipe = pipelines.TextToVideoPipeline.from_pretrained(str(tiny_wan_dir))

    def must_not_run(self):
        raise AssertionError("enable_embed_memo called on a model the memo does not fit")

    monkeypatch.setattr("metainfer_gen.video.cache.embed_memo.embed_memo_refusal",
                        lambda model: "no Wan condition embedder")
    monkeypatch.setattr(type(pipe), "enable_embed_memo", must_not_run)
    apply_model_options(pipe, _args())  # a default that does not apply is skipped, not an error
    assert not pipe.embed_memo_enabled
