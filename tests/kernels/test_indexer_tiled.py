"""The tiled indexer path against the reference: same selection (compared by the reference scores of the picked keys,
so exact ties may resolve either way) with many query and key tiles, causal prefill, padded decode rows, contexts
shorter than top-k, and keys cached in bf16 / fp8. Tolerance: atol=rtol=1e-5 on float32 scores."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen import kernels
from metainfer_gen.kernels import indexer
from metainfer_gen.kernels.indexer_tiled import indexer_topk_tiled

SCALE = 0.25


def _assert_same_selection(picked, q, w, keys, lengths, topk):
    ref_scores = indexer.indexer_scores_reference(q, w, keys, lengths, SCALE)
    want = indexer.indexer_topk_reference(q, w, keys, lengths, topk, SCALE)
    assert picked.shape == want.shape and picked.dtype == torch.long
    assert torch.equal(picked < 0, want < 0)  # the same number of real keys per query
    got_scores = ref_scores.gather(-1, picked.clamp_min(0)).masked_fill(picked < 0, 0)
    want_scores = ref_scores.gather(-1, want.clamp_min(0)).masked_fill(want < 0, 0)
    torch.testing.assert_close(got_scores, want_scores, atol=1e-5, rtol=1e-5)
    assert bool((picked < lengths.unsqueeze(-1)).all())


@pytest.mark.parametrize("topk", [1, 7, 16, 100])
def test_causal_prefill_over_many_tiles(topk):
    n, heads, dim, length = 37, 4, 16, 50
    q, w, keys = torch.randn(1, n, heads, dim), torch.randn(1, n, heads), torch.randn(1, length, dim)
    lengths = torch.arange(length - n + 1, length + 1)[None]  # the last n positions of a 50-token prompt
    picked = indexer_topk_tiled(q, w, keys, lengths, topk, SCALE, key_tile=8, tile_elements=4 * 8 * 3)
    _assert_same_selection(picked, q, w, keys, lengths, topk)


def test_padded_decode_rows_and_short_contexts():
    batch, heads, dim, length = 5, 3, 8, 30
    q, w, keys = torch.randn(batch, 1, heads, dim), torch.randn(batch, 1, heads), torch.randn(batch, length, dim)
    lengths = torch.tensor([[1], [4], [12], [29], [30]])  # rows shorter than top-k get -1 padding
    picked = indexer_topk_tiled(q, w, keys, lengths, 12, SCALE, key_tile=7, tile_elements=1)
    _assert_same_selection(picked, q, w, keys, lengths, 12)
    assert int((picked[0] >= 0).sum()) == 1 and int((picked[1] >= 0).sum()) == 4


def test_exact_ties_resolve_as_the_reference_resolves_them():
    """Keys that no head scores above 0 all score exactly 0; with fewer positive keys than top-k the choice among
    the zeros is the top-k's tie rule, which the tiled path reproduces (same row width, same -inf padding)."""
    batch, heads, dim, length = 6, 4, 8, 48
    direction = torch.randn(batch, 1, 1, dim)
    q = torch.rand(batch, 1, heads, 1) * direction  # every head along one direction per row
    sign = -torch.ones(length, 1)
    sign[::7] = 1  # a few keys along it (score > 0), the rest against it (every ReLU 0: score exactly 0)
    keys = sign * torch.rand(batch, length, 1) * direction[:, 0]
    w, lengths = torch.rand(batch, 1, heads), torch.tensor([[20], [31], [33], [40], [47], [48]])
    want = indexer.indexer_topk_reference(q, w, keys, lengths, 16, SCALE)
    scores = indexer.indexer_scores_reference(q, w, keys, lengths, SCALE)
    assert int((scores == 0).sum()) > batch * 16  # the top-16 includes zero-score ties
    assert torch.equal(indexer_topk_tiled(q, w, keys, lengths, 16, SCALE, tile_elements=1), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_low_precision_keys_are_scored_in_float32(dtype):
    """The cache may hold keys in bf16 or fp8: both paths upcast the same values, so they pick the same keys."""
    q, w = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 4)
    keys = torch.randn(2, 64, 16).to(dtype)
    lengths = torch.randint(20, 65, (2, 6))
    picked = indexer_topk_tiled(q, w, keys, lengths, 10, SCALE, key_tile=16, tile_elements=64)
    _assert_same_selection(picked, q, w, keys.float(), lengths, 10)


def test_dispatch_on_cpu_runs_the_tiled_path_and_says_why_not_triton():
    q, w, keys = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 4), torch.randn(1, 20, 16)
    with kernels.audit() as report:
        kernels.indexer_topk(q, w, keys, torch.tensor([[18, 19, 20]]), 5, SCALE)
    assert "torch-tiled" in report.paths()["indexer_topk"]


def test_topk_overlap_counts_shared_real_keys():
    ref = torch.tensor([[[0, 1, 2, 3]], [[5, 6, -1, -1]]])
    got = torch.tensor([[[3, 2, 9, 8]], [[6, 5, -1, -1]]])
    assert indexer.topk_overlap(got, ref) == pytest.approx(4 / 6)
    assert indexer.topk_overlap(ref, ref) == 1.0
