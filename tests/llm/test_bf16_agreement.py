"""bf16 on the CPU's matrix path keeps the model's answers: first tokens against transformers' bf16, recall intact."""

from __future__ import annotations

import random

import pytest
import torch

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from tests.llm.checkpoints import make_hf_model, random_prompts

FIRST = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


def first_tokens_transformers(model, prompts: list[list[int]]) -> list[int]:
    with torch.inference_mode():
        return [int(model(torch.tensor([p])).logits[0, -1].float().argmax()) for p in prompts]


def test_bf16_first_tokens_agree_with_transformers_bf16_on_64_prompts(tmp_path):
    model = make_hf_model("moe")
    model.save_pretrained(tmp_path)
    prompts = random_prompts(64, model.config.vocab_size, (5, 17, 33, 64, 100, 130))
    reference = first_tokens_transformers(model.to(torch.bfloat16), prompts)
    engine = LLMEngine.from_pretrained(tmp_path, EngineConfig(dtype="bfloat16", block_size=16))
    assert engine.dtype == torch.bfloat16
    ours = [o.token_ids[0] for o in engine.generate(prompts, FIRST)]
    agree = sum(a == b for a, b in zip(ours, reference)) / len(prompts)
    assert agree >= 0.95, f"{agree:.1%} of first tokens agree"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedded_llm_recalls_pass_keys_in_either_dtype(dtype):
    """The same 16 held-out pass keys in fp32 and bf16 (the full score: benchmarks/llm_bf16_quality.py)."""
    from demo_models.llm.data import passkey_example, prose_sentences
    from metainfer_gen.pipelines.text_generation import default_llm_dir

    rng = random.Random(77)
    sentences = prose_sentences()
    samples = [passkey_example(rng, sentences, 280 + 40 * i) for i in range(16)]
    engine = LLMEngine.from_pretrained(default_llm_dir(), EngineConfig(dtype=dtype))
    outputs = engine.generate([s.prompt for s in samples], SamplingParams(max_new_tokens=7, temperature=0.0))
    correct = sum(o.text.strip().startswith(s.answer) for o, s in zip(outputs, samples))
    assert correct >= 15, (dtype, [(o.text, s.answer) for o, s in zip(outputs, samples)])
