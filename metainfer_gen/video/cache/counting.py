"""Count transformer block evaluations, whatever cache (ours, diffusers', cache-dit) skipped some of them.

A forward hook on the block itself would also count blocks a cache short-circuits; one on a Linear inside the
block's attention only fires when the block really computes (see ``blocks.first_linear``). TaylorSeer, which
predicts attention outputs instead of skipping blocks, is counted as skipping the blocks whose attention it
predicted.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from metainfer_gen.video.cache.blocks import find_blocks, first_linear


class BlockCounter:
    """``num_evaluations``: block forward passes that ran; ``num_blocks``: blocks per transformer call."""

    def __init__(self) -> None:
        self.num_evaluations = 0
        self.num_blocks = 0

    def _count(self, *_args) -> None:
        self.num_evaluations += 1


@contextmanager
def count_block_evaluations(transformers: list[torch.nn.Module]) -> Iterator[BlockCounter]:
    """Count, inside the ``with``, the block evaluations of every transformer given (models without blocks count 0)."""
    counter = BlockCounter()
    handles = []
    for transformer in transformers:
        try:
            blocks = find_blocks(transformer)
        except ValueError:
            continue
        counter.num_blocks += len(blocks)
        for _, block in blocks:
            linear = first_linear(block)
            if linear is not None:
                handles.append(linear.register_forward_hook(counter._count))
    try:
        yield counter
    finally:
        for handle in handles:
            handle.remove()
