"""All-reduce (sum, in place): one-shot or two-shot over shared memory by measured size thresholds, else the backend.

Choice, per call:

1. ``low_precision="bf16"|"int8"`` (opt-in, float tensors only): the compressed one-shot; its relative error is
   reported in :func:`~metainfer_gen.collectives.dispatch.last_audit` and the returned handle's ``error``.
2. a same-host group with a shared-memory communicator and a CPU tensor: **one-shot** up to the group's
   ``one_shot_max_bytes``, **two-shot** above (thresholds from :mod:`.tuning`, measured once per machine).
3. otherwise the backend (gloo / NCCL), with each refused shared-memory path and its reason in the audit.

Sources followed: vLLM ``custom_all_reduce.py`` (``should_custom_ar`` size/world checks, one-shot vs two-shot by
size) and SGLang's ``custom_all_reduce`` fallbacks, with the refusals audited instead of logged once.
"""

from __future__ import annotations

import torch

from metainfer_gen.collectives.dispatch import caller_site, check_tensor, finish, resolve_group, run_shm, shm_refusals
from metainfer_gen.collectives.handles import BackendWork, Work
from metainfer_gen.collectives.lowp import SCHEMES

__all__ = ["ALGORITHMS", "all_reduce", "choose_algorithm"]

ALGORITHMS = ("one_shot", "two_shot", "backend")
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def choose_algorithm(tensor: torch.Tensor, group=None, low_precision: str | None = None):
    """The path :func:`all_reduce` would take for ``tensor``, without running it.

    Returns:
        ``(path, refusals, reason)``: path is "one_shot", "two_shot", "lowp_bf16", "lowp_int8" or "backend".
    """
    handle = resolve_group(group)
    return _choose(tensor, handle, low_precision, None)


def _choose(tensor, handle, low_precision, algorithm):
    nbytes = tensor.numel() * tensor.element_size()
    if handle.size == 1:
        return "local", (), "group of one rank"
    refusals = shm_refusals(handle, [tensor], "shm_one_shot")
    if refusals:
        return "backend", refusals, refusals[0].reason
    t = handle.thresholds
    if low_precision is not None:
        return f"lowp_{low_precision}", (), f"low_precision={low_precision!r} requested"
    if algorithm in ("one_shot", "two_shot", "backend"):
        return algorithm, (), f"algorithm={algorithm!r} requested"
    if nbytes <= t.one_shot_max_bytes:
        return "one_shot", (), f"{nbytes} B <= one-shot threshold {t.one_shot_max_bytes} B ({t.source})"
    return "two_shot", (), f"{nbytes} B > one-shot threshold {t.one_shot_max_bytes} B ({t.source})"


def all_reduce(tensor: torch.Tensor, group=None, *, async_op: bool = False, low_precision: str | None = None,
               algorithm: str | None = None, strict: bool | None = None, site: str | None = None):
    """Sum ``tensor`` over the ranks of ``group``, in place.

    Args:
        tensor: any shape, contiguous; float32, bfloat16, float16, float64, int8/uint8/int32/int64 (bool goes to
            the backend). CPU tensors take the shared-memory paths; CUDA tensors go to NCCL (audited).
        group: "world" (None), "tp", "cfg", "dp", or a :class:`GroupHandle`.
        async_op: return a :class:`~metainfer_gen.collectives.handles.Work` at once; the exchange runs on the
            communicator's worker thread, in call order. Do not touch ``tensor`` until ``wait()`` returns.
        low_precision: None (exact, default), "bf16" or "int8" (per-block scales): exchange a compressed copy;
            float tensors only. The relative error of this rank's contribution is in ``last_audit()``.
        algorithm: force "one_shot", "two_shot" or "backend" (benchmarks, tests); None chooses by size.
        strict: raise :class:`~metainfer_gen.kernels.registry.FastPathRefused` instead of falling back.
        site: call-site label in the audit; default the caller's ``file:line (function)``.
    Returns:
        ``tensor`` (or a Work whose ``wait()`` returns it).
    Raises:
        TypeError: not a tensor, unsupported dtype, low precision on a non-float tensor.
        ValueError: non-contiguous tensor, unknown algorithm or scheme, or ranks passing different sizes/dtypes
            (detected on the shared-memory path; every rank raises).
        CollectiveTimeout: a peer died or did not arrive within the timeout (the communicator is then unusable).
    """
    check_tensor("tensor", tensor, "all_reduce")
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS} or None; got {algorithm!r}")
    if low_precision is not None:
        if low_precision not in SCHEMES:
            raise ValueError(f"low_precision must be None or one of {SCHEMES}; got {low_precision!r}")
        if tensor.dtype not in _FLOAT:
            raise TypeError(f"low_precision all-reduce needs a float tensor; got {tensor.dtype}")
    handle = resolve_group(group)
    site = site or caller_site()
    path, refusals, reason = _choose(tensor, handle, low_precision, algorithm)
    nbytes = tensor.numel() * tensor.element_size()
    if path == "local" or tensor.numel() == 0:
        finish("all_reduce", handle, "local", (), reason if path == "local" else "empty tensor", nbytes, site, strict)
        return Work.completed(tensor) if async_op else tensor
    if path == "backend":
        import torch.distributed as dist

        finish("all_reduce", handle, get_backend_name(), refusals, reason, nbytes, site, strict)
        if handle.comm is not None:
            handle.comm.drain()
        work = dist.all_reduce(tensor, group=handle.group, async_op=async_op)
        return BackendWork(work, tensor) if async_op else tensor
    comm = handle.comm
    flat = tensor.view(-1)
    chunk = handle.thresholds.chunk_bytes
    if path.startswith("lowp_"):
        def run():
            _lowp(comm, flat, low_precision, chunk, handle, nbytes, reason)
    else:
        fn = comm.all_reduce_one_shot if path == "one_shot" else comm.all_reduce_two_shot

        def run():
            fn(flat, chunk)
    finish("all_reduce", handle, f"shm_{path}", refusals, reason, nbytes, site, strict)
    return run_shm(comm, run, tensor, async_op)


def _lowp(comm, flat, scheme, chunk, handle, nbytes, reason) -> None:
    from metainfer_gen.collectives import dispatch

    error = comm.all_reduce_low_precision(flat, scheme, chunk)
    dispatch._LAST[:] = [dispatch.CollectiveRecord("all_reduce", f"shm_lowp_{scheme}", (), reason, nbytes,
                                                   handle.name, error)]


def get_backend_name() -> str:
    """The backend the fallback uses ("gloo" or "nccl")."""
    from metainfer_gen.collectives.distributed import get_state

    return get_state().backend
