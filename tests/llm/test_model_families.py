"""The family table: which model types load, the attention path each names, and a clear refusal for DeepSeek-V4."""

from __future__ import annotations

import pytest

from metainfer_gen.llm import LLMEngine
from metainfer_gen.llm.models.families import FAMILIES, family_of


def test_supported_families_name_their_attention_path():
    assert [t for t, f in FAMILIES.items() if f.supported] == ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"]
    assert family_of("glm_moe_dsa").indexer_rope_interleaved and not family_of("deepseek_v32").indexer_rope_interleaved
    assert family_of("deepseek_v3").attention.startswith("MLA over the paged latent cache")
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported by the engine; supported: "
                                         r"\('deepseek_v3', 'deepseek_v32', 'glm_moe_dsa'\)"):
        family_of("llama")


def test_a_deepseek_v4_checkpoint_is_refused_with_what_is_missing(tmp_path):
    """transformers' own V4 config (every V4 field present); refused at the config, before any weight is read."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v4", num_hidden_layers=2, hidden_size=64, vocab_size=128)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="config.json: model_type 'deepseek_v4' is recognised but the engine cannot "
                                         "run it yet: it lacks paged caches for its attention state") as info:
        LLMEngine.from_pretrained(tmp_path)
    for feature in ("sliding window", "4x-compressed CSA entries", "128x-compressed HCA entries", "batched steps",
                    "tensor parallelism", "FP8", "llm/models/deepseek_v4.py"):
        assert feature in str(info.value)
