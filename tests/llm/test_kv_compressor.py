"""DeepSeek-V4's KV compressor (``llm/layers/kv_compressor.py``) against transformers' CSA / HCA compressors: one
whole prompt, and the same prompt in chunks whose ends fall inside windows, emit the same entries."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm.layers.kv_compressor import CompressorState, KVCompressor
from tests.llm.v4_checkpoints import compress_tables, make_hf_v4_model

LENGTH = 45  # 11 CSA windows (rate 4) and 5 HCA windows (rate 8), with a partial window left over


@pytest.fixture(scope="module")
def v4():
    return make_hf_v4_model()


def _ours(hf_compressor, config, overlap: bool) -> KVCompressor:
    ours = KVCompressor(config.hidden_size, hf_compressor.head_dim, hf_compressor.compress_rate, overlap,
                        int(config.head_dim * config.partial_rotary_factor), config.rms_norm_eps)
    missing, unexpected = ours.load_state_dict(hf_compressor.state_dict(), strict=False)
    assert not missing and all(k.startswith(("indexer.", "rotary_emb.")) for k in unexpected)
    return ours


@pytest.mark.parametrize("layer, overlap", [(1, True), (2, False)], ids=["csa", "hca"])
def test_whole_and_chunked_prefill_emit_transformers_entries(v4, layer, overlap):
    config = v4.config
    hf = v4.model.layers[layer].self_attn.compressor
    ours = _ours(hf, config, overlap)
    x = torch.randn(1, LENGTH, config.hidden_size)
    with torch.no_grad():
        expected = hf(x, torch.randn(1, LENGTH, config.q_lora_rank), torch.arange(LENGTH)[None], None, layer)[0]
    expected = expected[0, 0]  # (W, head_dim): every closed window of the prompt
    assert expected.shape[0] == LENGTH // hf.compress_rate
    cos, sin = compress_tables(config, LENGTH)
    with torch.no_grad():
        whole = ours(x[0], CompressorState(), cos, sin)
        state, parts = CompressorState(), []
        for lo, hi in ((0, 3), (3, 10), (10, 11), (11, 30), (30, LENGTH)):  # ends inside windows
            parts.append(ours(x[0, lo:hi], state, cos, sin))
    # float32 rounding: 1.2e-6 apart at one of 160 entries on an AMD EPYC (its GEMMs sum in another order)
    torch.testing.assert_close(whole, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat(parts), expected, atol=1e-6, rtol=1e-6)
    assert state.num_entries == expected.shape[0] and state.kv.shape[0] == LENGTH % hf.compress_rate
    assert [p.shape[0] for p in parts][:2] == [0, 10 // hf.compress_rate]


def test_overlap_makes_each_entry_depend_on_the_previous_window(v4):
    """CSA entry w mixes window w-1 (its Ca half): changing the tokens of window 0 changes entry 1, not entry 2."""
    config = v4.config
    ours = _ours(v4.model.layers[1].self_attn.compressor, config, overlap=True)
    cos, sin = compress_tables(config, 16)
    x = torch.randn(12, config.hidden_size)
    y = x.clone()
    y[:4] += 1.0
    with torch.no_grad():
        a, b = ours(x, CompressorState(), cos, sin), ours(y, CompressorState(), cos, sin)
    diff = (a - b).abs().amax(dim=-1)
    assert diff[0] > 1e-3 and diff[1] > 1e-3 and diff[2] == 0


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError, match="even rope_dim"):
        KVCompressor(64, 32, 4, True, 7, 1e-6)
