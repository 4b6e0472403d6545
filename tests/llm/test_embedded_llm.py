"""The embedded default LLM: ships in the package, loads with stock transformers and our engine, and recalls."""

from __future__ import annotations

import random

import pytest

from metainfer_gen import pipelines
from demo_models.llm.data import passkey_example, prose_sentences
from metainfer_gen.pipelines.text_generation import default_llm_dir


@pytest.fixture(scope="module")
def llm():
    return pipelines.TextGenerationPipeline.from_pretrained()


def test_layout_and_size():
    path = default_llm_dir()
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert sum(p.stat().st_size for p in path.iterdir()) < 8 * 2**20


def test_stock_transformers_loads_it():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_llm_dir())
    tokenizer = AutoTokenizer.from_pretrained(default_llm_dir())
    assert model.config.model_type == "deepseek_v3" and len(tokenizer) == model.config.vocab_size


def test_retrieves_passkeys(llm):
    """Eight fresh passkey samples of up to ~400 tokens (the full evaluation, 96% at 512 tokens over 50 samples, is
    `python -m demo_models.llm.evaluate`; key-value recall and copying are not learned yet)."""
    rng = random.Random(2024)
    sentences = prose_sentences()
    samples = [passkey_example(rng, sentences, 300 + 60 * i) for i in range(8)]
    outputs = llm([s.prompt for s in samples], max_new_tokens=7)
    correct = sum(o.text.strip().startswith(s.answer) for o, s in zip(outputs, samples))
    assert correct >= 7, [(o.text, s.answer) for o, s in zip(outputs, samples)]
    assert all(o.finish_reason == "stop" for o in outputs)  # the answer ends with <eos>
