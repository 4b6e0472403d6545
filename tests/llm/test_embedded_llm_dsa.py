"""The embedded LLM extended with DeepSeek-V3.2's indexer (dense warm-up distillation, ``assets/demo_llm_dsa``):
a standard ``deepseek_v32`` checkpoint whose sparse path runs through our engine and still retrieves passkeys."""

from __future__ import annotations

import random

import pytest
import torch

from metainfer_gen import kernels
from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
from demo_models.llm import configs
from demo_models.llm.data import prose_sentences
from demo_models.llm.evaluate import fit_passkey
from demo_models.llm.indexer_warmup import ASSET_DIR, set_attention
from metainfer_gen.pipelines.text_generation import default_llm_dir


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(ASSET_DIR, EngineConfig(max_model_len=configs.CONTEXT, block_size=64,
                                                             num_kv_blocks=48, enable_prefix_caching=False))


@pytest.fixture(scope="module")
def samples(engine):
    """Four passkey prompts of 300-500 tokens (at most the trained context)."""
    rng = random.Random(77)
    sentences = prose_sentences()
    return [fit_passkey(rng, engine.tokenizer, sentences, n) for n in (320, 384, 448, configs.CONTEXT)]


def test_standard_v32_checkpoint_extending_the_dense_model():
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ASSET_DIR)
    assert config.model_type == "deepseek_v32" and config.index_topk < configs.CONTEXT
    assert sum(p.stat().st_size for p in ASSET_DIR.iterdir()) < 8 * 2**20
    extended, dense = load_file(ASSET_DIR / "model.safetensors"), load_file(default_llm_dir() / "model.safetensors")
    indexer = {k for k in extended if ".self_attn.indexer." in k}
    assert len(indexer) == 5 * config.num_hidden_layers  # wq_b, wk, k_norm weight/bias, weights_proj per layer
    assert set(extended) - indexer == set(dense)
    for name, tensor in dense.items():  # the warm-up trains the indexer only
        assert torch.equal(extended[name], tensor), name


def test_sparse_path_runs_in_the_engine_and_retrieves(engine, samples):
    tokenizer = engine.tokenizer
    lengths = [len(tokenizer(s.prompt)["input_ids"]) for s in samples]
    topk = engine.model.model.layers[0].self_attn.indexer.topk
    assert min(lengths) > 4 * topk and max(lengths) <= configs.CONTEXT  # the indexer drops most of each
    params = SamplingParams(max_new_tokens=7, temperature=0)
    with kernels.audit() as report:
        outputs = engine.generate([s.prompt for s in samples], params)
    assert "indexer_topk" in report.paths() and "sparse_mla" in report.paths()
    correct = sum(o.text.strip().startswith(s.answer) for o, s in zip(outputs, samples))
    assert correct >= 3, [(o.text, s.answer) for o, s in zip(outputs, samples)]


def test_sparse_matches_transformers_and_differs_from_dense(engine, samples):
    """Stock transformers (``DeepseekV32ForCausalLM``, sparse through its indexer mask) gives the engine's sparse
    logits; and sparse attention is really sparse here: with every layer dense the last-token logits of a long
    prompt move, while the greedy answer stays the same."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(engine.encode(samples[-1].prompt))
    topk = engine.model.model.layers[0].self_attn.indexer.topk
    sparse = _last_logits(engine, ids)
    hf = AutoModelForCausalLM.from_pretrained(ASSET_DIR, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0, -1]
    torch.testing.assert_close(sparse, expected, atol=1e-3, rtol=0)
    set_attention(engine, None)
    try:
        dense = _last_logits(engine, ids)
    finally:
        set_attention(engine, topk)
    assert (dense - sparse).abs().max() > 1e-3
    assert int(dense.argmax()) == int(sparse.argmax())


def _last_logits(engine, ids: torch.Tensor) -> torch.Tensor:
    from metainfer_gen.llm.attention_metadata import AttentionMetadata

    block = engine.runner.kv_caches[0].shape[1]
    meta = AttentionMetadata.build([0], [len(ids)], [list(range(len(ids) // block + 1))], block)
    with torch.inference_mode():
        return engine.model.compute_logits(engine.model(ids, meta, engine.runner.kv_caches))[-1]
