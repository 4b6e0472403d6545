"""``--quantization``, ``--kv-cache-dtype`` and ``--enforce-eager`` on ``generate`` and ``serve``:
parsed once, reach the engine."""

from __future__ import annotations

import argparse

import pytest
import torch

from metainfer_gen.apps.cli import main
from metainfer_gen.apps.llm_args import engine_options
from metainfer_gen.apps.serve_cmd import add_serve_parser
from metainfer_gen.pipelines.text_generation import TextGenerationPipeline


def test_generate_runs_with_fp8_weights_and_an_fp8_kv_cache(text_checkpoint, monkeypatch, capsys):
    _, _, path = text_checkpoint
    loaded = []
    real = TextGenerationPipeline.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        loaded.append(real(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(TextGenerationPipeline, "from_pretrained", classmethod(spy))
    code = main(["generate", "the quick brown fox", "--model", str(path), "--max-new-tokens", "3",
                 "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert code == 0 and capsys.readouterr().out.strip()
    engine = loaded[0].engine
    assert engine.config.quantization == "fp8" and engine.cache_dtype == torch.float8_e4m3fn
    assert any(p.dtype == torch.float8_e4m3fn for p in engine.model.state_dict().values())


def test_serve_parses_the_same_options_and_refuses_others():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert engine_options(args) == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert engine_options(parser.parse_args(["serve"])) == {}
    assert engine_options(parser.parse_args(["serve", "--enforce-eager"])) == {"enforce_eager": True}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "int4"])
