"""Paged KV cache: slot mapping against a per-token loop, the Triton store against the reference store."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import kv_cache
from tests.kernels.conftest import requires_cuda


def _loop_slots(positions, seq_indices, block_tables, block_size):
    """The per-token definition, written as the obvious loop (the oracle for the vectorised version)."""
    out = []
    for pos, seq in zip(positions.tolist(), seq_indices.tolist()):
        out.append(-1 if pos < 0 else int(block_tables[seq, pos // block_size]) * block_size + pos % block_size)
    return torch.tensor(out, dtype=torch.int64)


def _lengths():
    """A fresh prefill, a prefix-cached prefill and a decode: (context_lens, query_lens)."""
    return torch.tensor([0, 5, 9]), torch.tensor([6, 3, 1])


def test_positions_from_lengths_lists_each_new_token():
    positions, seq_indices = kv_cache.positions_from_lengths(*_lengths())
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 7, 9]
    assert seq_indices.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 2]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_mapping_matches_the_per_token_loop(block_size):
    context_lens, query_lens = _lengths()
    block_tables = torch.randperm(64)[:3 * 10].view(3, 10).to(torch.int32)  # 10 blocks cover position 9
    positions, seq_indices = kv_cache.positions_from_lengths(context_lens, query_lens)
    positions = torch.cat([positions, torch.tensor([-1, -1])])  # CUDA-graph padding
    seq_indices = torch.cat([seq_indices, torch.tensor([0, 0])])
    slots = kv_cache.compute_slot_mapping(positions, seq_indices, block_tables, block_size)
    assert slots.dtype == torch.int64
    assert torch.equal(slots, _loop_slots(positions, seq_indices, block_tables, block_size))


def test_slot_mapping_rejects_positions_past_the_block_table():
    tables = torch.tensor([[3, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="unallocated block"):
        kv_cache.compute_slot_mapping(torch.tensor([5]), torch.tensor([0]), tables, 4)
    with pytest.raises(ValueError, match="needs block 2"):
        kv_cache.compute_slot_mapping(torch.tensor([9]), torch.tensor([0]), tables, 4)
    with pytest.raises(ValueError, match="block_size"):
        kv_cache.compute_slot_mapping(torch.tensor([1]), torch.tensor([0]), tables, 0)


def _cache_and_rows(dtype, num_tokens=10, heads=2, dim=8, num_blocks=32, block_size=4):
    k_cache = torch.randn(num_blocks, block_size, heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, dim).to(dtype)
    key = torch.randn(num_tokens, heads, dim).to(dtype)
    value = torch.randn(num_tokens, heads, dim).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1  # a padding token must not be written
    return key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_triton_store_is_bit_identical_to_the_reference(interpret, dtype):
    key, value, k_cache, v_cache, slots = _cache_and_rows(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv_cache.store_kv_cache_reference(key, value, ref_k, ref_v, slots)
    kv_cache.store_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    flat = ref_k.view(-1, 2, 8)
    assert torch.equal(flat[slots[0]].view(torch.uint8), key[0].view(torch.uint8))


def test_triton_store_of_an_mla_latent_cache_without_values_and_strided_keys(interpret):
    fused = torch.randn(6, 1, 40)  # keys are a strided slice of a wider projection
    key = fused[..., :24]
    k_cache = torch.zeros(8, 4, 1, 24)
    slots = torch.tensor([0, 5, 9, 30, -1, 2])
    ref = k_cache.clone()
    kv_cache.store_kv_cache_reference(key, None, ref, None, slots)
    kv_cache.store_kv_cache_triton(key, None, k_cache, None, slots)
    assert torch.equal(k_cache, ref)


def test_public_store_casts_to_the_cache_dtype_on_the_reference_path(no_interpret):
    key, value, k_cache, v_cache, slots = _cache_and_rows(torch.float8_e4m3fn)
    key32, value32 = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    kv_cache.store_kv_cache(key32, value32, k_cache, v_cache, slots)
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, 2, 8)[slots[keep]].view(torch.uint8),
                       key32[keep].to(torch.float8_e4m3fn).view(torch.uint8))
    with pytest.raises(ValueError, match="neither"):
        kv_cache.store_kv_cache(key32, value32, k_cache, None, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_cache.store_kv_cache(key32, value32, k_cache, v_cache, slots.float())


@requires_cuda
def test_cuda_triton_store_matches_reference():
    key, value, k_cache, v_cache, slots = (t.cuda() for t in _cache_and_rows(torch.bfloat16, 4096, 8, 128, 512, 16))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    assert kv_cache.STORE_KV_CACHE.select(key, value, k_cache, v_cache, slots)[0].name == "triton"
    kv_cache.store_kv_cache_reference(key, value, ref_k, ref_v, slots)
    kv_cache.store_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype,width", [(torch.float32, 576), (torch.bfloat16, 3), (torch.float8_e4m3fn, 6),
                                         (torch.float8_e4m3fn, 3)])
def test_the_reference_store_writes_every_bit_whatever_the_word_it_copies_by(dtype, width):
    """Rows are copied as the widest integer word their bytes and offset allow (int64 for 576 floats, bytes for 3
    fp8 values); a cache that starts one element into its storage still gets each row exactly where it belongs."""
    base = torch.zeros(1 + 4 * 2 * width, dtype=dtype)
    cache = base[1:].view(4, 2, width)  # offset by one element: narrower words line up, or bytes only
    for cache in (cache, torch.zeros(4, 2, width, dtype=dtype)):
        rows = torch.randn(3, width).to(dtype)
        kv_cache.store_kv_cache_reference(rows, None, cache, None, torch.tensor([5, -1, 0]))
        flat = cache.view(8, width).view(torch.uint8)
        assert torch.equal(flat[5], rows[0].view(torch.uint8)) and torch.equal(flat[0], rows[2].view(torch.uint8))
        assert int(flat[1:5].count_nonzero()) == 0 and int(flat[6:].count_nonzero()) == 0
