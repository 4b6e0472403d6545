"""DSA kernels: the indexer's top-k (clamping and padding) and sparse MLA, references and Triton under the
interpreter. Tolerance for sparse MLA: atol=rtol=1e-5 (float32, summation order)."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import indexer, sparse_attention


def _indexer_inputs(batch=2, n=5, heads=4, dim=16, length=40):
    lengths = torch.stack([torch.randint(1, length + 1, (n,)) for _ in range(batch)])
    lengths[0, 0] = 1  # a query that sees a single key
    return (torch.randn(batch, n, heads, dim), torch.randn(batch, n, heads), torch.randn(batch, length, dim),
            lengths)


def test_topk_is_clamped_and_padded_below_topk():
    q, w, keys, lengths = _indexer_inputs()
    picked = indexer.indexer_topk(q, w, keys, lengths, 8, 0.25)
    assert picked.shape == (2, 5, 8)
    for b in range(2):
        for i in range(5):
            real = picked[b, i][picked[b, i] >= 0]
            assert len(real) == min(8, int(lengths[b, i]))  # short contexts: every key, then -1 padding
            assert int(real.max()) < int(lengths[b, i])
    # top-k larger than the context: clamped to L, never an out-of-range index.
    assert indexer.indexer_topk(q, w, keys, lengths, 1000, 0.25).shape == (2, 5, 40)


def test_indexer_scores_follow_the_definition():
    q, w, keys, lengths = _indexer_inputs(batch=1, n=1, length=6)
    lengths[:] = 6
    scores = indexer.indexer_scores_reference(q, w, keys, lengths, 0.25)
    expected = [(w[0, 0] * torch.relu(0.25 * q[0, 0] @ keys[0, s])).sum() for s in range(6)]
    torch.testing.assert_close(scores[0, 0], torch.stack(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,software", [(torch.float32, None), (torch.float8_e4m3fn, False),
                                            (torch.float8_e4m3fn, True)], ids=["float32", "fp8", "fp8-soft-e4m3"])
def test_triton_indexer_matches_reference(interpret, dtype, software):
    q, w, keys, lengths = _indexer_inputs()
    keys = keys.to(dtype)  # an fp8 KV cache keeps the indexer keys in e4m3: scored after an exact upcast
    ref = indexer.indexer_scores_reference(q, w, keys, lengths, 0.25)
    picked = indexer.indexer_topk_triton(q, w, keys, lengths, 8, 0.25, software)
    # Same keys, or a tie within rounding: compare the scores of what each picked.
    got = ref.gather(-1, picked.clamp_min(0)).masked_fill(picked < 0, 0)
    want = ref.gather(-1, indexer.select_topk(ref, lengths, 8).clamp_min(0)).masked_fill(picked < 0, 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _mla_inputs(dtype=torch.float32, tokens=6, heads=4, rank=32, rope=8, slots=100, k=20):
    q = torch.randn(tokens, heads, rank + rope)
    rows = torch.randn(slots, rank + rope + 16).to(dtype)  # 16 trailing indexer-key columns are ignored
    idx = torch.randint(0, slots, (tokens, k))
    idx[0, 5:] = -1
    idx[1, ::2] = -1
    return q, rows, idx, rank


# soft-e4m3: the sm_80 path, fp8 rows decoded in the kernel from their uint8 codes (fp8_codec).
@pytest.mark.parametrize("dtype,software", [(torch.float32, None), (torch.float8_e4m3fn, False),
                                            (torch.float8_e4m3fn, True)], ids=["float32", "fp8", "fp8-soft-e4m3"])
def test_triton_sparse_mla_matches_reference(interpret, dtype, software):
    q, rows, idx, rank = _mla_inputs(dtype)
    ref = sparse_attention.sparse_mla_reference(q, rows, idx, rank, 0.2)
    torch.testing.assert_close(sparse_attention.sparse_mla_triton(q, rows, idx, rank, 0.2, software), ref,
                               atol=1e-5, rtol=1e-5)


def test_sparse_mla_over_every_row_is_dense_attention():
    q, rows, _, rank = _mla_inputs(slots=12)
    everything = torch.arange(12).expand(q.shape[0], 12)
    keys = rows[:, : q.shape[-1]]
    dense = torch.softmax((q @ keys.T) * 0.2, -1) @ rows[:, :rank]
    torch.testing.assert_close(sparse_attention.sparse_mla(q, rows, everything, rank, 0.2), dense, atol=1e-5,
                               rtol=1e-5)


def test_blocks_match_reference_and_bound_the_gather():
    from metainfer_gen.llm.memory_profile import StorageTracker

    q, rows, idx, rank = _mla_inputs(tokens=40, k=20)
    ref = sparse_attention.sparse_mla_reference(q, rows, idx, rank, 0.2)
    with StorageTracker() as tracker:
        out = sparse_attention.sparse_mla_blocks(q, rows, idx, rank, 0.2, block_rows=100)  # 5 queries per tile
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with StorageTracker() as whole:
        sparse_attention.sparse_mla_reference(q, rows, idx, rank, 0.2)
    assert tracker.peak < whole.peak / 3
    impl, _ = sparse_attention.SPARSE_MLA.select(q, rows, idx, rank, 0.2)
    assert impl.name == "torch-blocks"
