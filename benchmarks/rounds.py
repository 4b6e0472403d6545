"""What keeps the rows of the clip benchmarks (``step_cache.py``, ``lora.py``) comparable on a shared machine.

Rows run round-robin per prompt, so load drifting over the run hits all of them alike; each (row, prompt) is rendered
``repeats`` times in that order and the fastest clip counts (outputs are identical: same seed, same settings), since
single clips on a shared CPU vary by tenths of a second. PSNR of identical clips (infinite) counts as a cap.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import numpy as np

Item = TypeVar("Item")
Out = TypeVar("Out")

PSNR_CAP_DB = 100.0  # identical clips (infinite PSNR) count as 100 dB in the means


def round_robin(rows: dict[str, Callable[[int, Item], Out]], items: Sequence[Item], repeats: int = 1, *,
                seconds: Callable[[Out], float] = lambda out: out.stats.seconds,
                on_item: Callable[[int], None] | None = None) -> dict[str, list[Out]]:
    """``{row: [fastest output per item]}``: for each item, ``repeats`` rounds over every row in order.

    Args:
        rows: row name -> ``render(index, item)`` (one clip; the index is also the seed in both scripts).
        items: the prompts (or prompt/image pairs).
        repeats: rounds per item (>= 1); the output with the smallest ``seconds(out)`` counts.
        on_item: called with the item's index after its rounds (progress lines).
    Raises:
        ValueError: ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    outputs: dict[str, list[Out]] = {name: [] for name in rows}
    for index, item in enumerate(items):
        best: dict[str, Out] = {}
        for _ in range(repeats):
            for name, render in rows.items():
                out = render(index, item)
                if name not in best or seconds(out) < seconds(best[name]):
                    best[name] = out
        for name in rows:
            outputs[name].append(best[name])
        if on_item is not None:
            on_item(index)
    return outputs


def clip_psnr(frames: np.ndarray, reference: np.ndarray) -> float:
    """PSNR (dB) of uint8 ``frames`` against ``reference``, capped at :data:`PSNR_CAP_DB`."""
    from metainfer_gen.video.quality import psnr

    return min(psnr(frames, reference), PSNR_CAP_DB)
