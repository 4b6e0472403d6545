"""What every public collective shares: argument checks, group lookup, the audit record, the backend fallback.

Each call records ``(op, site, path, refusals)`` in :mod:`metainfer_gen.kernels.audit_log`, so
``kernels.audit()`` shows collectives beside kernels, and keeps a :class:`CollectiveRecord` with the reason for
the choice (:func:`last_audit`). Strict mode (``METAINFER_STRICT_FAST_PATH=1``) raises
:class:`~metainfer_gen.kernels.registry.FastPathRefused` instead of falling back to the backend.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch

from metainfer_gen.collectives.communicator import DTYPE_CODES
from metainfer_gen.collectives.distributed import GroupHandle, get_state
from metainfer_gen.kernels.audit_log import Refusal, record
from metainfer_gen.kernels.registry import FastPathRefused, strict_enabled

__all__ = ["CollectiveRecord", "caller_site", "check_tensor", "finish", "last_audit", "resolve_group", "run_shm",
           "shm_refusals"]

_BACKEND_DTYPES = tuple(DTYPE_CODES) + (torch.bool,)


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """The last collective this process ran.

    Attributes:
        op: "all_reduce", "all_gather" or "reduce_scatter".
        path: implementation that ran ("shm_one_shot", "shm_two_shot", "shm_lowp_int8", "gloo", "nccl" ...).
        refusals: faster implementations that did not apply, with the reason.
        reason: why this path among the applicable ones (size vs the measured threshold, ...).
        nbytes: message size per rank, bytes.
        group: group name ("world", "tp", ...).
        low_precision_error: relative L2 error this rank's contribution took from compression (None when exact).
    """

    op: str
    path: str
    refusals: tuple[Refusal, ...]
    reason: str
    nbytes: int
    group: str
    low_precision_error: float | None = None


_LAST: list[CollectiveRecord] = []


def last_audit() -> CollectiveRecord | None:
    """The :class:`CollectiveRecord` of the most recent collective in this process (None before any)."""
    return _LAST[-1] if _LAST else None


def caller_site(depth: int = 1) -> str:
    """``"file.py:line (function)"`` of the frame ``depth`` levels above the caller of this function.

    A public collective calls this directly in its body, so the default (1) names whoever called that
    collective: the user's line, ``"script.py:12 (<module>)"`` at a script's top level or
    ``"model.py:40 (forward)"`` inside a function. A stack shallower than ``depth`` names its outermost frame
    instead of raising: the audit label must never break the collective it labels.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame.f_back is None:
            break
        frame = frame.f_back
    return _site(frame.f_code, frame.f_lineno)


@functools.lru_cache(maxsize=4096)
def _site(code, lineno: int) -> str:
    return f"{os.path.basename(code.co_filename)}:{lineno} ({code.co_name})"


def resolve_group(group) -> GroupHandle:
    """A group name ("world", "tp", "cfg", "dp"), a :class:`GroupHandle`, or None (the world).

    Raises:
        RuntimeError: not initialised. ValueError: unknown name. TypeError: anything else.
    """
    state = get_state()
    if group is None:
        return state.groups["world"]
    if isinstance(group, GroupHandle):
        return group
    if isinstance(group, str):
        try:
            return state.groups[group]
        except KeyError:
            raise ValueError(f"unknown group {group!r}; have {sorted(state.groups)}") from None
    raise TypeError(f"group must be None, a group name or a GroupHandle; got {type(group).__name__} (raw "
                    f"torch.distributed groups are not accepted: their shared buffers are not set up)")


def check_tensor(name: str, t, op: str) -> None:
    """Raise a clear error for a tensor a collective cannot take.

    Raises:
        TypeError: not a tensor, or a dtype no path supports (complex, fp8, ...).
        ValueError: not contiguous.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in _BACKEND_DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in _BACKEND_DTYPES)
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: {supported}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass "
                         f"t.contiguous() and copy the result back")


def shm_refusals(handle: GroupHandle, tensors: list[torch.Tensor], impl: str) -> tuple[Refusal, ...]:
    """Why the shared-memory implementation ``impl`` cannot serve these tensors (empty when it can).

    Raises:
        CollectiveAborted: the group's communicator broke earlier (a peer died): falling back to the backend
            would hang on the dead peer, so this raises instead.
    """
    comm = handle.comm
    if comm is None:
        return (Refusal(impl, handle.comm_refusal or "no shared-memory communicator"),)
    comm.channel.check_usable()
    for t in tensors:
        if t.device.type != "cpu":
            return (Refusal(impl, f"tensor on {t.device}: {_device_reason()}; {get_state().backend} serves device "
                                  f"tensors"),)
        if t.dtype not in DTYPE_CODES:
            return (Refusal(impl, f"dtype {t.dtype} has no shared-memory kernel"),)
    return ()


@functools.lru_cache(maxsize=1)
def _device_reason() -> str:
    """Why device tensors skip the shared-memory path, with the links seen (probed once per process)."""
    from metainfer_gen.collectives.topology import LinkKind, gpu_links

    links = gpu_links()
    missing = sorted(pair for pair, kind in links.items() if kind == LinkKind.NO_PEER)
    seen = ", ".join(f"{i}-{j} {kind}" for (i, j), kind in sorted(links.items()) if i < j) or "one GPU visible"
    if missing:
        return (f"no peer access between GPU {missing[0][0]} and {missing[0][1]} (links: {seen}), and the CUDA IPC "
                f"all-reduce is not built in this version")
    return f"the CUDA IPC all-reduce is not built in this version (links: {seen})"


def finish(op: str, handle: GroupHandle, path: str, refusals: tuple[Refusal, ...], reason: str, nbytes: int,
           site: str, strict: bool | None, lowp_error: float | None = None) -> None:
    """Audit the choice (raising first in strict mode when something faster was refused)."""
    if refusals and strict_enabled(strict):
        raise FastPathRefused(op, site, path, refusals)
    record(op, site, path, refusals)
    if _LAST:
        _LAST[0] = CollectiveRecord(op, path, refusals, reason, nbytes, handle.name, lowp_error)
    else:
        _LAST.append(CollectiveRecord(op, path, refusals, reason, nbytes, handle.name, lowp_error))


def run_shm(comm, run, result, async_op: bool):
    """Run ``run()`` on the communicator: queued on its worker (returns a Work) or inline after the queue drains."""
    if async_op:
        return comm.submit(run, result=result)
    comm.drain()  # a synchronous call must not overtake queued asynchronous ones: peers run them in order
    run()
    return result
