"""Paged KV bookkeeping: fixed-size blocks, a free list in LRU order, reference counts and prefix caching.

Plain Python, no torch. Block ``b`` owns cache slots ``[b * block_size, (b + 1) * block_size)`` of every layer.
Prefix caching (vLLM's automatic prefix caching, nano-vllm's ``block_manager.py``): a *full* block whose KV has
been computed is registered under the hash of its tokens chained with the previous block's hash, so a later
sequence whose prompt starts with the same blocks reuses them (reference count + 1) instead of recomputing.
Freed blocks keep their hash and stay findable until the free list hands them out again (least recently freed
first, and a sequence's tail before its head), which makes the free list an LRU cache of prefixes.

A hash is only a lookup: a match compares the whole key the hash was made from (the key vLLM and nano-vllm
hash: the parent block's hash and the block's own tokens), block by block from the first. A reused block thus
holds the same tokens, computed after a prefix with the same chain hash as this sequence's; wrong KV would need
two different prefixes with equal 64-bit chain hashes, both cached. Comparing the tokens alone also reused a
block whose hash collided with the same tokens after another prefix.

Two rules keep shared blocks correct, where nano-vllm's first version was not:
- a block is registered only after its KV is written (``commit``), never at allocation, so a sequence admitted in
  the same step cannot reuse a block whose prefill chunk has not run yet;
- a prompt never reuses the block holding its last token: at least one token is always computed, to produce the
  logits of the first output token, and it must not be written into a block other sequences read.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from metainfer_gen.llm.sequence import Sequence

_NO_HASH = None


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = _NO_HASH
    token_ids: tuple[int, ...] = ()
    parent_hash: int | None = _NO_HASH  # hash of the block before it when registered (None: the first block)


def chain_hash(prefix_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first block).

    Python's hash of a tuple of ints is deterministic across runs (no salt). A lookup by this hash is confirmed
    by comparing its whole key (``prefix_hash`` and the token ids, see :meth:`BlockManager.match_prefix`), so two
    keys that collide are told apart.
    """
    return hash((prefix_hash, *token_ids))


class BlockManager:
    """Allocates KV blocks to sequences.

    Args:
        num_blocks: blocks in the pool (the cache tensors' first dimension), >= 1.
        block_size: tokens per block (page size), >= 1.
        enable_prefix_caching: register and reuse full computed blocks.
    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self.num_prefix_hits = 0  # blocks reused from the prefix cache, for stats
        self.num_prefix_queries = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so ``seq`` can hold ``num_computed_tokens + num_new_tokens`` tokens."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # -- prefix cache ---------------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks that start ``seq``'s tokens; returns the number of tokens they hold.

        Only called for a sequence holding no blocks (first admission or after preemption). Sets
        ``num_computed_tokens`` and ``num_cached_tokens``. A block found by its chain hash is taken only when its
        tokens and its parent's hash equal this sequence's (the hash alone may collide).
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        matched = 0
        if self.enable_prefix_caching:
            prefix_hash = None
            # Blocks entirely before the last token only (see the module docstring).
            for index in range((len(seq) - 1) // self.block_size):
                tokens = tuple(seq.block_tokens(index, self.block_size))
                parent_hash, prefix_hash = prefix_hash, chain_hash(prefix_hash, tokens)
                block_id = self._hash_to_block.get(prefix_hash)
                self.num_prefix_queries += 1
                if block_id is None:
                    break
                block = self.blocks[block_id]
                if block.token_ids != tokens or block.parent_hash != parent_hash:
                    break
                self._take(block_id)
                seq.block_table.append(block_id)
                matched += 1
            self.num_prefix_hits += matched
        seq.num_computed_tokens = seq.num_cached_tokens = matched * self.block_size
        seq.num_hashed_blocks = matched
        return seq.num_computed_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are full and computed (call after each step); each block is
        hashed once (``seq.num_hashed_blocks`` remembers where the chain stopped)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = seq.num_hashed_blocks
        prefix_hash = self.blocks[seq.block_table[start - 1]].hash if start else None
        for index in range(start, num_full):
            block = self.blocks[seq.block_table[index]]
            if block.hash is None:
                tokens = tuple(seq.block_tokens(index, self.block_size))
                block.hash = chain_hash(prefix_hash, tokens)
                block.token_ids = tokens
                block.parent_hash = prefix_hash
                # Identical content computed twice (two prompts admitted together) keeps the first registration.
                self._hash_to_block.setdefault(block.hash, block.block_id)
            prefix_hash = block.hash
        seq.num_hashed_blocks = max(start, num_full)

    # -- allocation -----------------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` the blocks for ``num_new_tokens`` more tokens.

        Raises:
            RuntimeError: not enough free blocks (check ``can_allocate(blocks_needed(...))`` first).
        """
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"need {needed} KV blocks, {len(self._free)} free")
        for _ in range(needed):
            block_id = next(iter(self._free))
            self._take(block_id)
            self._evict(block_id)
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (tail first, so a prefix's head outlives its tail in the LRU)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if block.ref_count == 0:
                if block.hash is None or self._hash_to_block.get(block.hash) != block_id:
                    self._clear(block)  # unregistered content is useless once free
                self._free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        """A reused free block gets new content: drop its old registration."""
        block = self.blocks[block_id]
        if block.hash is not None and self._hash_to_block.get(block.hash) == block_id:
            del self._hash_to_block[block.hash]
        self._clear(block)

    @staticmethod
    def _clear(block: Block) -> None:
        block.hash = _NO_HASH
        block.token_ids = ()
        block.parent_hash = _NO_HASH

    def scratch_blocks(self, num_blocks: int) -> list[int]:
        """Ids of up to ``num_blocks`` free blocks that hold no registered prefix, without taking them: writing
        them loses nothing (the engine's warm-up fills them with dummy KV; the next allocation overwrites it)."""
        ids = [b for b in self._free if self.blocks[b].hash is None]
        return ids[:num_blocks]

    def reset_prefix_cache(self) -> None:
        """Forget every registered prefix (blocks in use keep their content)."""
        for block in self.blocks:
            if block.ref_count == 0:
                self._clear(block)
        self._hash_to_block = {h: b for h, b in self._hash_to_block.items() if self.blocks[b].ref_count > 0}
