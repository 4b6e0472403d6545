"""The family table: which model types load, the attention path each names, and the settings DeepSeek-V4 refuses."""

from __future__ import annotations

import pytest

from metainfer_gen.llm.models.families import FAMILIES, family_of


def test_supported_families_name_their_attention_path():
    assert [t for t, f in FAMILIES.items() if f.supported] == ["deepseek_v3", "deepseek_v32", "glm_moe_dsa",
                                                                "deepseek_v4"]
    assert family_of("glm_moe_dsa").indexer_rope_interleaved and not family_of("deepseek_v32").indexer_rope_interleaved
    assert family_of("deepseek_v3").attention.startswith("MLA over the paged latent cache")
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported by the engine; supported: "
                                         r"\('deepseek_v3', 'deepseek_v32', 'glm_moe_dsa', 'deepseek_v4'\)"):
        family_of("llama")


def test_deepseek_v4_runs_and_names_its_attention_path():
    """V4 loads now (tests/llm/test_deepseek_v4_engine.py runs it); its path names the paged window and the
    compressed entries, and the settings it cannot use yet are refused before any weight is read."""
    from transformers import AutoConfig

    from metainfer_gen.llm.models.families import check_engine_settings

    family = family_of("deepseek_v4")
    assert family.attention.startswith("sliding-window K=V rows + compressed entries")
    assert "paged pool" in family.attention
    config = AutoConfig.for_model("deepseek_v4", num_hidden_layers=2, hidden_size=64, vocab_size=128)
    check_engine_settings(config)  # the defaults are fine
    check_engine_settings(config, tensor_parallel_size=4)  # split over heads, groups, experts (test_deepseek_v4_tp)
    with pytest.raises(ValueError, match=r"deepseek_v4 cannot be split over tensor_parallel_size=3"):
        check_engine_settings(config, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="not yet for deepseek_v4"):
        check_engine_settings(config, quantization="fp8")
    check_engine_settings(AutoConfig.for_model("deepseek_v3"), tensor_parallel_size=4, quantization="fp8")
