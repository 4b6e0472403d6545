"""DeepSeek-V4's compressed entries a tile at a time (``llm/layers/v4_entries.py``) against one call over every
entry: the CSA indexer's running top-k gives the whole row's picks, exact ties at 0 straddling the k-th place
included (they go to one ``torch.topk`` over the whole row); HCA's online softmax equals one softmax."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm.layers import v4_entries
from metainfer_gen.llm.layers.v4_entries import EntryReader, attend_entries, top_entries
from tests.llm.v4_checkpoints import V4

RATE = 4


def _config(**overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model("deepseek_v4", bos_token_id=None, eos_token_id=None, **{**V4, **overrides})


def _reader(rows: torch.Tensor, num: int) -> EntryReader:
    """Entries at rows scattered through a pool (entry e at pool row perm[e]): block size = rate, one slot a block,
    the block table a permutation."""
    perm = torch.randperm(rows.shape[0])[:num]
    return EntryReader(rows, lambda positions: perm[positions // RATE] * RATE, RATE, RATE, 1, num)


@pytest.mark.parametrize("zero_keys", [0, 30])
def test_running_top_k_equals_one_call_over_every_entry(monkeypatch, zero_keys):
    """40 entries in tiles of 3; queries that see all of them (decode) and fewer (prefill rows, some below k).
    With 30 zero keys, scores tie at exactly 0 across the k-th place and the picks must still be the same."""
    from metainfer_gen.llm.layers.v4_attention import Indexer

    monkeypatch.setattr(v4_entries, "ENTRY_TILE_TOKENS", 3 * RATE)
    torch.manual_seed(0)
    indexer = Indexer(_config(index_topk=8), rope_dim=8)
    num, dim = 40, indexer.head_dim
    keys = torch.randn(num, dim)
    keys[torch.randperm(num)[:zero_keys]] = 0.0
    pool = torch.randn(64, 5 + dim)
    reader = _reader(pool, num)
    pool[reader.index(torch.arange(num)), 5:] = keys
    positions = torch.tensor([4 * num - 1, 4 * num - 2, 100, 30, 20, 3])  # complete: 40, 39, 25, 7, 5, 1
    q, weights = torch.randn(6, indexer.num_heads, dim), torch.randn(6, indexer.num_heads)
    want = indexer.top_entries(q, weights, keys, positions)
    got = top_entries(indexer, q, weights, reader, slice(5, None), positions, budget=100)
    assert torch.equal(got[1], want[1])
    for row in range(6):  # a query's valid picks are the same entries (tied ones may come in another order)
        assert sorted(got[0][row][got[1][row]].tolist()) == sorted(want[0][row][want[1][row]].tolist()), row
    if zero_keys:
        scores = indexer.scores(q[:1], weights[:1], keys)[0]
        assert (scores.sort(descending=True).values[7:9] == 0).all()  # the decode query's k-th place ties at 0


def test_hca_online_softmax_equals_one_softmax(monkeypatch):
    """Window keys plus 37 entries in tiles of 5, queries at several positions, against the layer's own one-softmax
    ``_attend`` over the window and every entry."""
    from metainfer_gen.llm.layers.v4_attention import V4Attention

    monkeypatch.setattr(v4_entries, "ENTRY_TILE_TOKENS", 5 * RATE)
    torch.manual_seed(1)
    config = _config(layer_types=["heavily_compressed_attention"] * 3,
                     compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": RATE})
    attn = V4Attention(config, 2)
    with torch.no_grad():
        attn.sinks.normal_(0, 1)
    num, dim, rows = 37, attn.head_dim, 4
    entries = torch.randn(num, dim)
    pool = torch.randn(50, dim)
    reader = _reader(pool, num)
    pool[reader.index(torch.arange(num))] = entries
    window = torch.randn(16, dim)
    positions = torch.tensor([4 * num - 1, 90, 41, 2])
    visible = torch.rand(rows, 16) < 0.7
    visible[:, -1] = True
    q = torch.randn(rows, attn.num_heads, dim)
    complete = torch.arange(num)[None] < ((positions + 1) // RATE)[:, None]
    want = attn._attend(q, torch.cat([window, entries]), torch.cat([visible, complete], dim=1))
    got = attend_entries(attn, q, window, visible, reader, positions)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
