"""Block manager bookkeeping, without a model: allocation, reference counts, prefix reuse, LRU eviction."""

from __future__ import annotations

import pytest

from metainfer_gen.llm.block_manager import BlockManager
from metainfer_gen.llm.sequence import SamplingParams, Sequence


def seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_new_tokens=4))


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What the scheduler + runner do for a whole prompt: match, allocate, compute, commit."""
    bm.match_prefix(s)
    bm.allocate(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = len(s)
    bm.commit(s)


def test_allocate_and_free_restores_pool():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    run_prefill(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == [] and s.num_computed_tokens == 0


def test_prefix_blocks_shared_with_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(13)), seq(list(range(8)) + [99, 98, 97])
    run_prefill(bm, a)
    assert bm.match_prefix(b) == 8  # two full blocks shared
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    bm.allocate(b, b.num_uncomputed_tokens)
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_last_prompt_token_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(8))
    run_prefill(bm, a)
    b = seq(range(8))  # identical prompt: the second block holds its last token, so it is recomputed
    assert bm.match_prefix(b) == 4


def test_uncomputed_blocks_are_not_shared():
    """A block allocated for a prefill chunk that has not run yet must not be found by another sequence."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(12))
    bm.match_prefix(a)
    bm.allocate(a, 12)  # scheduled, not yet computed
    assert bm.match_prefix(seq(range(12))) == 0


def test_freed_prefix_survives_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    bm.free(a)
    b = seq([1, 2, 3, 4, 9])
    assert bm.match_prefix(b) == 4 and bm.num_prefix_hits == 2  # reused after being freed
    bm.free(b)
    # Filling the pool with other content evicts the old prefix.
    c = seq([7] * 8)
    run_prefill(bm, c)
    bm.free(c)
    assert bm.match_prefix(seq([1, 2, 3, 4, 9])) == 0


def test_tail_block_evicted_before_head():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    head, tail = a.block_table[0], a.block_table[1]
    bm.free(a)
    x = seq([8, 8])
    bm.allocate(x, 2)  # takes the least recently freed: the unregistered partial block first, then the tail
    y = seq([9, 9])
    bm.allocate(y, 2)
    assert tail in x.block_table + y.block_table and head not in x.block_table + y.block_table
    assert bm.match_prefix(seq([1, 2, 6])) == 2  # the head block is still cached


def test_allocate_beyond_capacity_raises():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(range(12))
    assert not bm.can_allocate(bm.blocks_needed(s, 12))
    with pytest.raises(RuntimeError, match="need 3 KV blocks, 2 free"):
        bm.allocate(s, 12)


def test_prefix_caching_off_never_matches():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(range(12))
    run_prefill(bm, a)
    assert bm.match_prefix(seq(range(12))) == 0


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match=">= 1"):
        BlockManager(num_blocks, block_size)


def test_a_hash_collision_with_another_prefix_is_not_reused(monkeypatch):
    """A block with the same tokens whose hash collides but whose parent differs holds KV computed after another
    prefix: the match compares the parent's hash too, so it is recomputed, not reused."""
    from metainfer_gen.llm import block_manager

    # Every block's hash now ignores its prefix: [4, 5, 6, 7] after [0, 1, 2, 3] collides with [4, 5, 6, 7] first.
    monkeypatch.setattr(block_manager, "chain_hash", lambda prefix_hash, token_ids: hash(tuple(token_ids)))
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(9))
    run_prefill(bm, a)
    b = seq([4, 5, 6, 7, 8])  # its first block has a's second block's tokens and hash, at another position
    assert bm.match_prefix(b) == 0 and b.block_table == []
    assert bm.match_prefix(seq(range(9))) == 8  # the same prefix still shares both blocks
