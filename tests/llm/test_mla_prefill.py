"""Blockwise MLA prefill against whole-context causal attention (the expanded form in one softmax), both forms,
with and without a cached prefix, at chunk sizes that split the context and the diagonal. float32: atol = rtol =
1e-5 (summation order); the absorbed form reassociates the products, so it gets 2e-5."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config

from metainfer_gen.llm import attention_chunks
from metainfer_gen.llm.layers import mla_prefill
from metainfer_gen.llm.layers.mla import MLAttention


@pytest.fixture(scope="module")
def attn():
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    torch.manual_seed(0)
    layer = MLAttention(config, 0, softmax_scale=24 ** -0.5)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _whole_context(attn, q_nope, q_pe, context, start):
    """Causal attention of n queries at positions start.. over all start + n rows at once (the path the blocks
    replace)."""
    c_kv, k_pe = context[:, : attn.latent_size].split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_nope, v = attn.kv_b_proj(c_kv).view(-1, attn.num_heads, 32).split([16, 16], dim=-1)
    scores = torch.einsum("qnd,knd->nqk", q_nope, k_nope) + torch.einsum("qnd,kd->nqk", q_pe, k_pe)
    q_pos = torch.arange(start, start + q_nope.shape[0])
    causal = torch.arange(context.shape[0])[None, :] <= q_pos[:, None]
    probs = (scores * attn.softmax_scale).masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("nqk,knd->qnd", probs, v)


@pytest.mark.parametrize("start,n", [(0, 70), (45, 30), (200, 3), (0, 1000)])
@pytest.mark.parametrize("chunk", [64, 256, None])
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
@torch.inference_mode()
def test_blocks_match_whole_context(attn, start, n, chunk, form):
    length = start + n
    rows = torch.randn(length + 50, attn.latent_size + 8)  # spare rows and trailing indexer columns
    slots = torch.randperm(length + 50)[:length]
    q_nope, q_pe = torch.randn(n, 4, 16), torch.randn(n, 4, 8)
    expected = _whole_context(attn, q_nope, q_pe, rows[slots], start)
    fn = mla_prefill._expanded if form == "expanded" else mla_prefill._absorbed
    out = fn(attn, q_nope, q_pe, rows, slots, start, chunk or attention_chunks.key_chunk(4, n))
    tol = 1e-5 if form == "expanded" else 2e-5
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_form_follows_the_multiply_adds(attn):
    # 2 n (2r + dr) < r (dn + dv) + n (dn + dr + dv): 144 n < 1024 + 40 n, below 9.8 queries for these dims.
    dims = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    assert attention_chunks.absorbed_is_cheaper(*dims, 9) and not attention_chunks.absorbed_is_cheaper(*dims, 10)


def test_key_chunk_bounds_the_scores():
    assert attention_chunks.key_chunk(16, 2048) == 256  # the floor: 2^22 / (16 x 2048) = 128
    assert attention_chunks.key_chunk(8, 64) == 8192
    assert 8 * 300 * attention_chunks.key_chunk(8, 300) <= attention_chunks.PREFILL_SCORE_BUDGET


def test_planner_reads_the_kernels_decode_group():
    from metainfer_gen.kernels import paged_mla

    assert attention_chunks.DECODE_GROUP_ROWS == paged_mla.DECODE_GROUP_ROWS
    assert attention_chunks.decode_group_tokens(16, 16) == 512 and attention_chunks.decode_group_tokens(1024, 16) == 16
