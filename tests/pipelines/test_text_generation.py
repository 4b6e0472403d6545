"""TextGenerationPipeline and `metainfer-gen generate` on a tiny checkpoint with a tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from metainfer_gen import pipelines
from metainfer_gen.apps.cli import main
from tests.llm.checkpoints import hf_greedy


def test_pipeline_text_in_text_out(text_checkpoint):
    model, tokenizer, path = text_checkpoint
    pipe = pipelines.TextGenerationPipeline.from_pretrained(path, torch_dtype=torch.float32, block_size=8)
    prompt = "the quick brown fox"
    out = pipe(prompt, max_new_tokens=6, ignore_eos=True)
    ids = tokenizer(prompt)["input_ids"]
    assert out.prompt_token_ids == ids
    assert out.token_ids == hf_greedy(model, ids, 6)
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "length" and out.ttft > 0 and out.mean_token_latency > 0
    batch = pipe([prompt, "the pass key is"], max_new_tokens=3, ignore_eos=True)
    assert [len(o.token_ids) for o in batch] == [3, 3] and batch[0].token_ids == out.token_ids[:3]


def test_pipeline_rejects_bad_settings_before_work(text_checkpoint):
    _, _, path = text_checkpoint
    pipe = pipelines.TextGenerationPipeline.from_pretrained(path)
    with pytest.raises(ValueError, match="top_p"):
        pipe("hello", top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        pipe("hello", temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        pipe("hello", max_new_tokens=0)
    assert not pipe.engine.has_unfinished_requests


def test_cli_generate_json(text_checkpoint, capsys):
    _, _, path = text_checkpoint
    code = main(["generate", "the quick brown fox", "the lazy dog", "--model", str(path), "--max-new-tokens", "4",
                 "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and [line["prompt"] for line in lines] == ["the quick brown fox", "the lazy dog"]
    assert all(1 <= len(line["token_ids"]) <= 4 and line["ttft_s"] > 0 for line in lines)


def test_cli_generate_errors(text_checkpoint, tmp_path, capsys):
    _, _, path = text_checkpoint
    assert main(["generate", "hi", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(path), "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_cli_refuses_empty_text_and_unusable_devices(text_checkpoint, capsys):
    _, _, path = text_checkpoint
    assert main(["generate", "  ", "--model", str(path)]) == 2
    assert "empty prompt" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(path), "--device", "tpu0"]) == 2
    assert "is not a device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", "hi", "--model", str(path), "--device", "cuda"]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err
