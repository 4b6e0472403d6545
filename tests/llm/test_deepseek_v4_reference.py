"""DeepSeek-V4's non-paged reference path (``llm/models/deepseek_v4.py``) against transformers' ``deepseek_v4`` on
tiny random models: prompts longer than the sliding window and many compression windows, several layer-type
mixes, prefill whole or in chunks ending inside windows, then decode."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm.models.deepseek_v4 import DeepseekV4Reference
from tests.llm.checkpoints import hf_greedy, random_prompts
from tests.llm.v4_checkpoints import V4, make_hf_v4_model

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
MIXES = {
    "sliding-csa-hca": V4["layer_types"],
    "hca-csa-csa": [HCA, CSA, CSA],
    "csa-sliding-hca-csa": [CSA, SLIDING, HCA, CSA],
}
LENGTHS = (5, 17, 45, 70)  # below the window (16), past it, and 11-17 CSA / 5-8 HCA windows


@pytest.fixture(scope="module", params=sorted(MIXES))
def v4(request):
    types = MIXES[request.param]
    mlp = ["hash_moe"] + ["moe"] * (len(types) - 1)
    model = make_hf_v4_model(num_hidden_layers=len(types), layer_types=types, mlp_layer_types=mlp)
    return model, DeepseekV4Reference.from_hf(model, 128)


def test_prefill_logits_equal_transformers(v4):
    hf, ours = v4
    for prompt in random_prompts(len(LENGTHS), hf.config.vocab_size, LENGTHS, seed=3):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours(torch.tensor(prompt), 0, ours.new_state()), expected, atol=1e-5, rtol=0)


def test_greedy_tokens_equal_transformers_whole_and_chunked(v4):
    hf, ours = v4
    for prompt in random_prompts(3, hf.config.vocab_size, (17, 45, 70), seed=4):
        expected = hf_greedy(hf, prompt, 16)
        assert ours.greedy(prompt, 16) == expected
        assert ours.greedy(prompt, 16, chunk=7) == expected  # chunk ends inside CSA (4) and HCA (8) windows
        assert ours.greedy(prompt, 16, chunk=1) == expected  # token by token: every step a decode


def test_the_indexer_top_k_and_the_compressed_entries_matter(v4):
    """Attending every complete CSA entry (top-k above their count), or none of any compressed layer's, changes
    the logits of a 70-token prompt: both paths are exercised, not bypassed."""
    _, ours = v4
    prompt = torch.tensor(random_prompts(1, ours.config.vocab_size, (70,), seed=5)[0])
    reference = ours(prompt, 0, ours.new_state())
    layers = [layer.self_attn for layer in ours.model.layers]
    compressors = [a.compressor for a in layers]
    csa = [c.indexer for c in compressors if c is not None and hasattr(c, "indexer")]
    for indexer in csa:
        indexer.topk = 1000
    if csa:
        assert (ours(prompt, 0, ours.new_state()) - reference).abs().max() > 1e-4
    for indexer in csa:
        indexer.topk = ours.config.index_topk
    for attn in layers:
        attn.compressor = None
    assert (ours(prompt, 0, ours.new_state()) - reference).abs().max() > 1e-4
    for attn, compressor in zip(layers, compressors):
        attn.compressor = compressor


def test_positions_past_the_tables_are_refused(v4):
    _, ours = v4
    with pytest.raises(ValueError, match="exceed max_positions=128"):
        ours(torch.zeros(4, dtype=torch.long), 126, ours.new_state())


def test_state_bytes_equal_the_config_formula_at_8k_and_32k():
    """The reference path's own accounting (every tensor it keeps) against ``llm/plan_v4.py``'s formula, after 8K
    and after 32K tokens of one prefill fed in chunks that end inside windows."""
    from metainfer_gen.llm.plan_v4 import v4_state_bytes

    hf = make_hf_v4_model(num_hidden_layers=2, layer_types=[CSA, HCA], mlp_layer_types=["hash_moe", "moe"],
                          num_attention_heads=2, index_n_heads=2, compress_rates={CSA: 16, HCA: 64})  # 32K: 2K entries
    ours = DeepseekV4Reference.from_hf(hf, 32768)
    state, chunk = ours.new_state(), 4099
    ids = torch.randint(0, hf.config.vocab_size, (32768,), generator=torch.Generator().manual_seed(0))
    for context in (8192, 32768):
        for lo in range(context - 8192 if context == 8192 else 8192, context, chunk):
            ours(ids[lo:min(lo + chunk, context)], lo, state)
        formula = v4_state_bytes(hf.config.to_dict(), context, 4)
        assert sum(s.nbytes for s in state) == formula["total"], context
        assert formula["entries"] == 4 * 32 * (context // 16 + context // 64)  # one CSA, one HCA layer, D = 32
