"""The length a model was trained at, stored beside it: past it, TextGenerationPipeline warns with both lengths.

The embedded LLM was trained at ``demo_models.llm.configs.CONTEXT`` (512) tokens but accepts
``max_position_embeddings`` (2,048); a longer prompt runs but returns garbage, so the call says so.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings

import pytest

from demo_models.llm import configs
from metainfer_gen import pipelines
from metainfer_gen.pipelines.loading import SETTINGS_FILE


@pytest.fixture(scope="module")
def embedded():
    return pipelines.TextGenerationPipeline.from_pretrained(device="cpu")


def _no_warning(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        return call()


def _ids(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of ordinary (non-special) tokens of the embedded tokenizer."""
    rng = random.Random(seed)
    return [rng.randrange(10, configs.VOCAB_SIZE) for _ in range(n)]


@pytest.mark.parametrize("asset", ["demo_llm", "demo_llm_dsa"])
def test_shipped_llms_store_the_length_they_were_trained_at(asset):
    from metainfer_gen.pipelines.text_generation import default_llm_dir, trained_context

    path = default_llm_dir().parent / asset
    assert json.loads((path / SETTINGS_FILE).read_text())["trained_context"] == configs.CONTEXT == 512
    assert trained_context(path) == 512


def test_a_passkey_prompt_past_the_trained_length_warns_with_both_lengths(embedded):
    from demo_models.llm.data import passkey_example, prose_sentences

    example = passkey_example(random.Random(7), prose_sentences(), 4000)
    num_tokens = len(embedded.engine.encode(example.prompt))
    assert configs.CONTEXT < num_tokens < embedded.engine.max_model_len - 8
    with pytest.warns(UserWarning) as caught:
        out = embedded([example.prompt, "The pass key is 1. What is the pass key? The pass key is"], max_new_tokens=8)
    messages = [str(w.message) for w in caught if "trained at" in str(w.message)]
    assert len(messages) == 1, messages  # once for the batch
    assert f"{num_tokens} tokens" in messages[0] and "512 tokens" in messages[0] and "max_new_tokens=8" in messages[0]
    assert len(out) == 2 and all(o.finish_reason in ("stop", "length") for o in out)  # it still runs


def test_prompt_plus_new_tokens_past_the_trained_length_warns_and_within_it_does_not(embedded):
    prompt = _ids(configs.CONTEXT - 12)
    _no_warning(lambda: embedded([prompt], max_new_tokens=12, ignore_eos=True))  # exactly 512: fine
    _no_warning(lambda: embedded("The pass key is 12345. What is the pass key? The pass key is", max_new_tokens=8))
    with pytest.warns(UserWarning, match=r"prompt 0 \(500 tokens\) \+ max_new_tokens=13 .*513 tokens.* 512 tokens"):
        embedded([prompt], max_new_tokens=13, ignore_eos=True)


def test_a_checkpoint_without_the_settings_file_never_warns(text_checkpoint, tmp_path):
    _, _, path = text_checkpoint
    pipe = pipelines.TextGenerationPipeline.from_pretrained(path, device="cpu")
    assert pipe.trained_context is None
    long = [[7] * (pipe.engine.max_model_len - 20)]
    _no_warning(lambda: pipe(long, max_new_tokens=8, ignore_eos=True))

    copy = tmp_path / "with_settings"
    shutil.copytree(path, copy)
    (copy / SETTINGS_FILE).write_text(json.dumps({"trained_context": 64}))
    with pytest.warns(UserWarning, match=r"past the 64 tokens this model was trained at"):
        pipelines.TextGenerationPipeline.from_pretrained(copy, device="cpu")(long, max_new_tokens=8)
    (copy / SETTINGS_FILE).write_text(json.dumps({"trained_context": "long"}))
    with pytest.raises(ValueError, match="trained_context must be a positive number of tokens"):
        pipelines.TextGenerationPipeline.from_pretrained(copy, device="cpu")


def test_the_demo_build_writes_the_trained_length(text_checkpoint, tmp_path):
    from demo_models.llm.build import build

    _, _, path = text_checkpoint
    build(path, tmp_path / "asset")
    assert json.loads((tmp_path / "asset" / SETTINGS_FILE).read_text()) == {"trained_context": configs.CONTEXT}
