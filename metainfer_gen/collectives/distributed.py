"""Process-group setup from torchrun's environment: backend, TP / CFG / DP groups, shared-memory communicators.

    torchrun --nproc-per-node 2 script.py
    # script.py
    from metainfer_gen import collectives
    state = collectives.init_distributed(tensor_parallel_size=2)   # gloo on CPU, NCCL on GPU
    collectives.all_reduce(x, group="tp")
    collectives.shutdown_distributed()                             # also registered with atexit

Rank layout: ``world = dp x cfg x cp x tp`` with the TP index varying fastest (ranks 0..tp-1 form the first TP group),
then context parallelism (one clip's tokens), as in Megatron-LM and vLLM's ``initialize_model_parallel``. Every group
with more than one rank whose ranks share a host gets a
:class:`~metainfer_gen.collectives.communicator.ShmCommunicator`; the others keep the reason why not,
and their collectives go to the backend with that reason in the audit.
"""

from __future__ import annotations

import atexit
import itertools
import dataclasses
import datetime
import os
import socket
from dataclasses import dataclass, field

__all__ = ["DistributedState", "GroupHandle", "TIMEOUT_ENV", "free_port", "get_state", "init_distributed",
           "is_initialized", "launched_world_size", "shutdown_distributed"]

TIMEOUT_ENV = "METAINFER_COLLECTIVES_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_SLOT_BYTES = 4 << 20


@dataclass(slots=True)
class GroupHandle:
    """One process group and what serves it.

    Attributes:
        name: "world", "tp", "cp", "cfg" or "dp".
        group: the ``torch.distributed`` group (None means the default group).
        ranks: global ranks of the members, in group-rank order.
        rank: this process's rank within the group.
        comm: the shared-memory communicator, or None (then ``comm_refusal`` says why).
        thresholds: the one-shot / two-shot thresholds for ``comm`` (None without it).
    """

    name: str
    group: object
    ranks: tuple[int, ...]
    rank: int
    comm: object = None
    comm_refusal: str | None = None
    thresholds: object = None

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)


@dataclass(slots=True)
class DistributedState:
    """Everything :func:`init_distributed` set up.

    Attributes:
        rank / world_size / local_rank: global rank, world size, rank on this host (``LOCAL_RANK``).
        backend: "gloo" or "nccl".
        device: ``torch.device`` this rank computes on (``cuda:<local_rank>`` with NCCL, else cpu).
        tensor_parallel_size / cfg_parallel_size / data_parallel_size / context_parallel_size: the layout.
        groups: "world", "tp", "cp", "cfg", "dp" -> :class:`GroupHandle` (this rank's group of each kind).
        owns_process_group: True when this call created the default group (teardown destroys it).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: object
    tensor_parallel_size: int
    cfg_parallel_size: int
    data_parallel_size: int
    groups: dict = field(default_factory=dict)
    owns_process_group: bool = False
    context_parallel_size: int = 1


_STATE: list[DistributedState] = []


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for launching local ranks without torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def launched_world_size() -> int:
    """``WORLD_SIZE`` as torchrun set it, 1 when unset (reads the environment only; initialises nothing).

    Raises:
        ValueError: a value that is not a positive integer.
    """
    world = _env_int("WORLD_SIZE", 1)
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE={world} is not a positive integer")
    return world


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    return value


def init_distributed(tensor_parallel_size: int = 1, cfg_parallel_size: int = 1, *, backend: str | None = None,
                     timeout_s: float | None = None, slot_bytes: int = DEFAULT_SLOT_BYTES,
                     tune: bool | None = None, context_parallel_size: int = 1) -> DistributedState:
    """Initialise torch.distributed from the environment torchrun sets, and the parallel groups on top.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; without them it starts a
    one-process world. Reuses a default group that is already initialised. Calling it twice returns the first
    state (the sizes must match).

    Args:
        tensor_parallel_size / cfg_parallel_size / context_parallel_size: group sizes; the data-parallel size is
            what remains of the world.
        backend: "gloo" or "nccl"; None picks NCCL when CUDA is available, else gloo.
        timeout_s: longest wait for a peer in any collective, seconds (default ``$METAINFER_COLLECTIVES_TIMEOUT``
            or 60); also the backend's timeout.
        slot_bytes: per-rank shared buffer per round (bytes); segments take ``2 x world x slot_bytes`` per group.
        tune: measure all-reduce thresholds when none are cached (None reads ``METAINFER_COLLECTIVES_TUNE``).
    Returns:
        the :class:`DistributedState` (also available from :func:`get_state`).
    Raises:
        ValueError: sizes that do not divide the world size, bad environment values, an unknown backend.
    """
    import torch
    import torch.distributed as dist

    _check_size("tensor_parallel_size", tensor_parallel_size)
    _check_size("cfg_parallel_size", cfg_parallel_size)
    _check_size("context_parallel_size", context_parallel_size)
    _check_size("slot_bytes", slot_bytes)
    if _STATE:
        state = _STATE[-1]
        have = (state.tensor_parallel_size, state.cfg_parallel_size, state.context_parallel_size)
        if have != (tensor_parallel_size, cfg_parallel_size, context_parallel_size):
            raise ValueError(f"already initialised with (tp, cfg, cp) = {have}; call shutdown_distributed() first")
        return state
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0; got {timeout_s!r}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl'; got {backend!r}")

    owns = not dist.is_initialized()
    if owns:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if os.environ["WORLD_SIZE"] != "1":
                raise ValueError("MASTER_PORT is not set; launch with torchrun (or set MASTER_ADDR/MASTER_PORT)")
            os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group(backend=backend, init_method="env://", rank=_env_int("RANK", 0),
                                world_size=_env_int("WORLD_SIZE", 1),
                                timeout=datetime.timedelta(seconds=timeout_s))
    backend = dist.get_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = _env_int("LOCAL_RANK", rank)
    model_parallel = tensor_parallel_size * cfg_parallel_size * context_parallel_size
    if world % model_parallel:
        raise ValueError(f"world size {world} is not divisible by tensor_parallel_size x cfg_parallel_size x "
                         f"context_parallel_size = {tensor_parallel_size} x {cfg_parallel_size} x "
                         f"{context_parallel_size}")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    state = DistributedState(rank=rank, world_size=world, local_rank=local_rank, backend=backend, device=device,
                             tensor_parallel_size=tensor_parallel_size, cfg_parallel_size=cfg_parallel_size,
                             data_parallel_size=world // model_parallel, owns_process_group=owns,
                             context_parallel_size=context_parallel_size)
    layouts = {"world": [list(range(world))],
               **_layout(world, tensor_parallel_size, cfg_parallel_size, context_parallel_size)}
    for name, all_ranks in layouts.items():
        if name != "world" and len(all_ranks[0]) == world:  # same members as the world group: share its buffers
            state.groups[name] = dataclasses.replace(state.groups["world"], name=name)
            continue
        state.groups[name] = _build_group(name, all_ranks, rank, timeout_s, slot_bytes, tune)
    _STATE.append(state)
    if len(_STATE) == 1:
        atexit.register(_atexit)
    return state


def _layout(world: int, tp: int, cfg: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Member lists of every TP, CP, CFG and DP group
    (rank = ((dp_idx * cfg + cfg_idx) * cp + cp_idx) * tp + tp_idx)."""
    sizes = {"dp": world // (tp * cfg * cp), "cfg": cfg, "cp": cp, "tp": tp}
    axes = list(sizes)  # slowest first
    ids = list(itertools.product(*(range(n) for n in sizes.values())))
    rank_of = {ix: k for k, ix in enumerate(ids)}
    groups = {}
    for name in ("tp", "cp", "cfg", "dp"):
        axis = axes.index(name)
        others = sorted({ix[:axis] + ix[axis + 1:] for ix in ids})
        groups[name] = [[rank_of[o[:axis] + (i,) + o[axis:]] for i in range(sizes[name])] for o in others]
    return groups


def _build_group(name: str, all_ranks: list[list[int]], rank: int, timeout_s: float, slot_bytes: int,
                 tune: bool | None) -> GroupHandle:
    import torch.distributed as dist

    from metainfer_gen.collectives.communicator import ShmCommunicator
    from metainfer_gen.collectives.topology import gather_topology
    from metainfer_gen.collectives.tuning import load_or_measure

    mine = next(r for r in all_ranks if rank in r)
    group = None
    if len(all_ranks[0]) != dist.get_world_size():
        for members in all_ranks:  # every rank creates every group, in the same order (torch requires it)
            g = dist.new_group(members)
            if rank in members:
                group = g
    handle = GroupHandle(name=name, group=group, ranks=tuple(mine), rank=mine.index(rank))
    if len(mine) == 1:
        handle.comm_refusal = "group of one rank: nothing to exchange"
        return handle
    topo = gather_topology(group)
    handle.comm, handle.comm_refusal = ShmCommunicator.create(group, topo, slot_bytes, timeout_s, tag=name)
    if handle.comm is not None:
        handle.thresholds = load_or_measure(handle.comm, group, tune=tune)
    return handle


def is_initialized() -> bool:
    """True between :func:`init_distributed` and :func:`shutdown_distributed`."""
    return bool(_STATE)


def get_state() -> DistributedState:
    """The current state.

    Raises:
        RuntimeError: :func:`init_distributed` has not been called.
    """
    if not _STATE:
        raise RuntimeError("collectives are not initialised; call metainfer_gen.collectives.init_distributed() "
                           "(under torchrun) first")
    return _STATE[-1]


def shutdown_distributed() -> None:
    """Finish queued asynchronous collectives, release the shared memory, destroy groups this module created."""
    if not _STATE:
        return
    state = _STATE.pop()
    for handle in {id(h.comm): h for h in state.groups.values()}.values():  # shared comms closed once
        if handle.comm is not None:
            try:
                if handle.comm.usable:
                    handle.comm.drain()
            finally:
                handle.comm.close()
    if state.owns_process_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _atexit() -> None:
    try:
        shutdown_distributed()
    except Exception:  # interpreter shutdown: nothing useful to report, and the segments are already unlinked
        pass
