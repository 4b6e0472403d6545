"""All-gather and reduce-scatter over the group, into flat output tensors (``torch.distributed``'s ``*_tensor``
signatures): shared memory for same-host CPU groups, the backend otherwise, audited like :func:`all_reduce`.

Source followed: ``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor`` for the argument
order and layout (rank ``q``'s part at ``output[q * n:(q + 1) * n]``); vLLM's ``GroupCoordinator`` for the
fallbacks when the backend lacks the fused form.
"""

from __future__ import annotations

import torch

from metainfer_gen.collectives.dispatch import caller_site, check_tensor, finish, resolve_group, run_shm, shm_refusals
from metainfer_gen.collectives.handles import Work

__all__ = ["all_gather", "reduce_scatter"]


def _check_pair(op: str, output, input, out_factor: int, in_factor: int) -> None:
    check_tensor("output", output, op)
    check_tensor("input", input, op)
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{op}: output on {output.device}, input on {input.device}; both must be on one device")
    if output.numel() * out_factor != input.numel() * in_factor:
        want = (f"{input.numel() * in_factor} (input numel {input.numel()} x world size {in_factor})"
                if in_factor > 1 else f"input numel {input.numel()} / world size {out_factor}")
        raise ValueError(f"{op}: output has {output.numel()} elements; it needs {want}")
    if op == "reduce_scatter" and input.numel() % out_factor:
        raise ValueError(f"reduce_scatter: input numel {input.numel()} is not divisible by the world size "
                         f"{out_factor}")


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, *, async_op: bool = False,
               strict: bool | None = None, site: str | None = None):
    """Concatenate every rank's ``input`` into ``output`` (rank ``q``'s at ``output.view(-1)[q*n:(q+1)*n]``).

    Args:
        output: contiguous, ``world_size x input.numel()`` elements, same dtype and device as ``input``.
        input: contiguous, any shape; the same numel and dtype on every rank.
        group / async_op / strict / site: as for :func:`~metainfer_gen.collectives.allreduce.all_reduce` (on the
            backend path an ``async_op`` call runs synchronously and returns a completed Work).
    Returns:
        ``output`` (or a Work whose ``wait()`` returns it).
    Raises:
        TypeError: non-tensor, unsupported or mismatched dtype. ValueError: non-contiguous, wrong output size,
        devices differ, or ranks passing different sizes. CollectiveTimeout: a peer died or timed out.
    """
    handle = resolve_group(group)
    _check_pair("all_gather", output, input, 1, handle.size)
    return _run("all_gather", handle, output, input, async_op, strict, site or caller_site())


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, *, async_op: bool = False,
                   strict: bool | None = None, site: str | None = None):
    """Sum ``input`` over the ranks and keep this rank's part: ``output = sum_q input_q.view(-1)[r*n:(r+1)*n]``.

    Args:
        output: contiguous, ``input.numel() / world_size`` elements, same dtype and device.
        input: contiguous, numel divisible by the world size; the same on every rank.
        group / async_op / strict / site: as for :func:`~metainfer_gen.collectives.allreduce.all_reduce`.
    Returns:
        ``output`` (or a Work whose ``wait()`` returns it).
    Raises:
        as :func:`all_gather`.
    """
    handle = resolve_group(group)
    _check_pair("reduce_scatter", output, input, handle.size, 1)
    return _run("reduce_scatter", handle, output, input, async_op, strict, site or caller_site())


def _run(op: str, handle, output, input, async_op, strict, site):
    nbytes = input.numel() * input.element_size()
    if handle.size == 1 or input.numel() == 0:
        finish(op, handle, "local", (), "group of one rank" if handle.size == 1 else "empty tensor", nbytes, site,
               strict)
        output.view(-1).copy_(input.view(-1))
        return Work.completed(output) if async_op else output
    refusals = shm_refusals(handle, [input, output], f"shm_{op}")
    if refusals:
        return _backend(op, handle, output, input, refusals, nbytes, site, strict, async_op)
    finish(op, handle, f"shm_{op}", (), "same-host group with shared buffers", nbytes, site, strict)
    comm, chunk = handle.comm, handle.thresholds.chunk_bytes
    fn = comm.all_gather if op == "all_gather" else comm.reduce_scatter

    def run():
        fn(input.view(-1), output.view(-1), chunk)

    return run_shm(comm, run, output, async_op)


def _backend(op, handle, output, input, refusals, nbytes, site, strict, async_op):
    import torch.distributed as dist

    from metainfer_gen.collectives.allreduce import get_backend_name

    finish(op, handle, get_backend_name(), refusals, refusals[0].reason, nbytes, site, strict)
    if handle.comm is not None:
        handle.comm.drain()
    if op == "all_gather":
        # torch 2.13 renamed all_gather_into_tensor (now deprecated with a warning) to all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(output.view(-1), input.view(-1), group=handle.group)
    else:
        dist.reduce_scatter_tensor(output.view(-1), input.view(-1), group=handle.group)
    return Work.completed(output) if async_op else output
