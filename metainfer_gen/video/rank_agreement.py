"""What ranks that render one clip together must agree on before the first step: the same call, one seed.

Used by CFG-parallel (:mod:`metainfer_gen.video.cfg_parallel`) and context parallelism
(:mod:`metainfer_gen.video.context_parallel`): every rank of the group runs the same script, and a call whose
arguments differ between ranks, or that draws its noise from each rank's own generator, would mix two clips.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["agree_on_call", "call_fingerprint", "group_handle"]


def group_handle(name: str):
    """This rank's :class:`~metainfer_gen.collectives.distributed.GroupHandle` ``name`` ("cfg", "cp", "world"...),
    or None when collectives are not initialised."""
    from metainfer_gen.collectives.distributed import get_state, is_initialized

    return get_state().groups[name] if is_initialized() else None


def call_fingerprint(call: dict[str, Any]) -> int:
    """A 63-bit hash of a pipeline call's arguments: tensors, arrays and images by their bytes, callables by name.

    Equal on two ranks exactly when they make the same call (object addresses never enter it).
    """

    def encode(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        if hasattr(value, "tobytes"):  # numpy arrays, PIL images
            size = getattr(value, "shape", None) or getattr(value, "size", None)
            return f"{type(value).__name__}{size}:{hashlib.sha256(value.tobytes()).hexdigest()}"
        if callable(value):
            return getattr(value, "__qualname__", type(value).__name__)
        return type(value).__name__

    text = json.dumps(call, sort_keys=True, default=encode)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def agree_on_call(handle, fingerprint: int, seed: int | None, has_generator: bool, what: str,
                  drawn: bool = False) -> int | None:
    """Check that every rank of ``handle``'s group makes the same call and give them all one seed.

    One all-gather of three int64 values per rank. A call without ``seed`` and ``generator`` would draw different
    noise on each rank: all then use the seed drawn on group rank 0 (from torch's global generator). A
    ``generator`` passed by the caller cannot be compared: it must be seeded alike on every rank.

    Args:
        handle: the group (None or one rank: nothing to agree, ``seed`` is returned). what: the feature named in
            the error ("CFG-parallel", "context-parallel").
        drawn: ``seed`` was drawn by an earlier agreement (another group's rank 0), not given by the caller:
            it is this rank's candidate, and group rank 0's is used, as for a call without a seed.
    Returns:
        the seed to use (``seed``, or group rank 0's draw).
    Raises:
        ValueError: the ranks' arguments differ (raised on every rank, so none waits for the others).
    """
    if handle is None or handle.size < 2:
        return seed
    from metainfer_gen.collectives import all_gather
    from metainfer_gen.collectives.distributed import get_state

    drawn = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
    mine = torch.tensor([fingerprint, drawn, int(has_generator)], dtype=torch.int64, device=get_state().device)
    rows = torch.empty(handle.size, 3, dtype=torch.int64, device=mine.device)
    all_gather(rows, mine, group=handle, site="rank_agreement.agree_on_call")
    rows = rows.cpu().tolist()
    prints = {row[0] for row in rows}
    if len(prints) > 1:
        listed = " and ".join(f"{row[0]:x}" for row in rows)
        raise ValueError(f"{what} ranks were called with different arguments (fingerprints {listed}): every rank "
                         "must make the same pipeline call")
    if (seed is not None and not drawn) or has_generator:
        return seed
    return rows[0][1]
