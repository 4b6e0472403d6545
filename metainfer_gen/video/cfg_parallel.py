"""CFG-parallel denoising: the conditional and unconditional transformer passes of every step on two ranks.

    torchrun --nproc-per-node 2 script.py
    # script.py
    pipe = pipelines.TextToVideoPipeline.from_pretrained()
    pipe.enable_cfg_parallel()            # init_distributed(cfg_parallel_size=2) when torchrun started 2+ ranks
    out = pipe("a red circle moving right", guidance_scale=5.0, seed=0)   # the same clip on both ranks
    out.stats.extra["cfg_parallel"]       # path, reason, exchanges, calls this rank skipped

How. Diffusers' Wan pipelines call the transformer twice per step, ``cond`` then ``uncond``, on the same latents
and timestep, and combine the two predictions only after the second call. A hook on each transformer (a diffusers
``ModelHook``, registered for the length of one pipeline call, so it is outside any step cache) pairs those two
calls. CFG rank 0 computes the first, CFG rank 1 the second; the call a rank does not compute returns at once. At
the second call the ranks all-gather their predictions over the CFG group
(:func:`metainfer_gen.collectives.all_gather`: shared memory on one host, else the backend); rank 0 returns the
gathered unconditional prediction, and rank 1 fills in place the empty tensor its first call returned with the
conditional one. Both ranks then hold the same two predictions, so the pipeline's own guidance formula and
scheduler step leave identical latents on every rank: the denoising loop is not forked. The loop order this relies
on (the first output is not read before the second call) is the Wan pipelines'; every pair is checked (same
timestep and latent shape) and a mismatch raises instead of mixing steps.

Each rank keeps one branch: a step cache on rank 0 sees only ``cond`` calls and on rank 1 only ``uncond`` calls,
so its per-branch decisions are those of one process and its stats on each rank cover that rank's branch.

Source followed: xDiT (xfuser) CFG parallelism, which splits the batched cond/uncond input over two ranks and
all-gathers the noise predictions; here the split is over the two calls the pipeline already makes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Iterator

import torch
from diffusers.hooks.hooks import HookRegistry

from metainfer_gen.video.cfg_parallel_hook import CFG_PARALLEL_HOOK, CfgParallelHook, _Pair
from metainfer_gen.video.rank_agreement import group_handle

__all__ = ["AUDIT_OP", "CFG_PARALLEL_HOOK", "CfgParallelConfig", "CfgParallelHook", "CfgParallelRecord", "CfgPath",
           "PAIRED_CALL_PIPELINES", "apply_cfg_parallel", "cfg_parallel_hooks",
           "connect_cfg_group", "plan_cfg_parallel", "remove_cfg_parallel"]

AUDIT_OP = "cfg_parallel"
# Diffusers pipelines that call the transformer once per CFG branch (cond, then uncond) and combine after the second.
PAIRED_CALL_PIPELINES = frozenset({"WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"})
_GROUPS = ("cfg", "world", "dp", "tp")


class CfgPath(str, Enum):
    """Which way a call ran its CFG branches."""

    PARALLEL = "cfg_parallel"  # cond on CFG rank 0, uncond on CFG rank 1, one all-gather per step
    SEQUENTIAL = "sequential"  # both branches on this rank, one after the other (the ordinary path)
    SINGLE_BRANCH = "single_branch"  # guidance off: one transformer pass per step, nothing to split


@dataclass(slots=True)
class CfgParallelConfig:
    """Settings of CFG-parallel denoising.

    Attributes:
        group: the :mod:`metainfer_gen.collectives` group whose two ranks share the branches ("cfg"; "world" on a
            job of two ranks set up with another layout).
    Raises:
        ValueError: an unknown group name.
    """

    group: str = "cfg"

    def __post_init__(self) -> None:
        if self.group not in _GROUPS:
            raise ValueError(f"group must be one of {_GROUPS}; got {self.group!r}")


@dataclass(slots=True)
class CfgParallelRecord:
    """What one pipeline call did about CFG parallelism (``out.stats.extra["cfg_parallel"]``, and the audit).

    Attributes:
        path: a :class:`CfgPath` value. reason: why this path; for a fallback, why not ``cfg_parallel``.
        rank / group_size: this process in the CFG group (0 / 1 when there is none).
        num_exchanges: all-gathers of noise predictions (one per step on the parallel path).
        num_skipped_calls: transformer calls this rank returned without computing (one per step).
        exchange_seconds: wall time inside those all-gathers, waiting for the peer included, in seconds.
    """

    path: str
    reason: str
    rank: int = 0
    group_size: int = 1
    num_exchanges: int = 0
    num_skipped_calls: int = 0
    exchange_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _handle(config: CfgParallelConfig):
    """This rank's collectives group for ``config`` (None when collectives are not initialised)."""
    return group_handle(config.group)


def connect_cfg_group(config: CfgParallelConfig) -> None:
    """Set up the CFG group when torchrun started several ranks and nobody initialised collectives yet.

    With ``WORLD_SIZE`` unset or 1 nothing is initialised (calls then fall back, saying so). Otherwise
    ``init_distributed(cfg_parallel_size=2)``: ranks ``2k`` and ``2k + 1`` share the branches, the other pairs
    form the data-parallel group.

    Raises:
        ValueError: an odd world size, or a CFG group of more than two ranks (CFG has two branches).
    """
    from metainfer_gen.collectives import distributed

    if not distributed.is_initialized():
        world = distributed.launched_world_size()
        if world == 1:
            return
        if world % 2:
            raise ValueError(f"CFG-parallel pairs ranks; WORLD_SIZE={world} is odd: launch an even number "
                             "(torchrun --nproc-per-node 2)")
        distributed.init_distributed(cfg_parallel_size=2)
    handle = _handle(config)
    if handle.size > 2:
        raise ValueError(f"the {config.group!r} group has {handle.size} ranks; CFG has two branches: "
                         "init_distributed(cfg_parallel_size=2)")


def plan_cfg_parallel(config: CfgParallelConfig, pipeline: Any, guidance_scale: float | None) -> CfgParallelRecord:
    """Decide how the coming call runs its CFG branches, and why (no device work, no communication).

    Args:
        pipeline: the diffusers pipeline about to be called. guidance_scale: the call's guidance weight.
    Raises:
        ValueError: the pipeline is not on this rank's device (NCCL ranks each own one GPU).
    """
    handle = _handle(config)
    rank, size = (handle.rank, handle.size) if handle is not None else (0, 1)

    def record(path: CfgPath, reason: str) -> CfgParallelRecord:
        return CfgParallelRecord(path.value, reason, rank=rank, group_size=size)

    if guidance_scale is None or guidance_scale <= 1:
        return record(CfgPath.SINGLE_BRANCH, f"guidance_scale={guidance_scale} <= 1: one transformer pass per step, "
                                             "no unconditional pass to move to another rank")
    if handle is None:
        return record(CfgPath.SEQUENTIAL, "one process (WORLD_SIZE unset or 1): no second rank for the "
                                          "unconditional pass; launch with torchrun --nproc-per-node 2")
    if size == 1:
        return record(CfgPath.SEQUENTIAL, f"the {config.group!r} group has 1 rank (cfg_parallel_size=1 in "
                                          "init_distributed): no second rank for the unconditional pass")
    name = type(pipeline).__name__
    if name not in PAIRED_CALL_PIPELINES:
        return record(CfgPath.SEQUENTIAL, f"{name} is not known to call the transformer once per CFG branch "
                                          f"(supported: {', '.join(sorted(PAIRED_CALL_PIPELINES))})")
    from metainfer_gen.collectives.distributed import get_state

    state = get_state()
    device = torch.device(str(pipeline.device))
    if state.backend == "nccl" and device != state.device:
        raise ValueError(f"the pipeline is on {device} but this rank computes on {state.device}: load it with "
                         "device=str(collectives.get_state().device)")
    return record(CfgPath.PARALLEL, f"guidance_scale={guidance_scale} > 1 on a {size}-rank {config.group!r} group: "
                                    "cond on rank 0, uncond on rank 1, one all-gather per step")


def apply_cfg_parallel(transformer: torch.nn.Module, record: CfgParallelRecord,
                       config: CfgParallelConfig | None = None) -> CfgParallelHook:
    """Attach the pairing hook to ``transformer`` (outermost: register it after any cache).

    Args:
        record: the call's record, from :func:`plan_cfg_parallel`; counts accumulate into it.
    Raises:
        ValueError: the hook is already attached, or collectives are not initialised with a two-rank group.
    """
    config = CfgParallelConfig() if config is None else config
    handle = _handle(config)
    if handle is None or handle.size != 2:
        raise ValueError(f"CFG-parallel needs a two-rank {config.group!r} group; have "
                         f"{'none' if handle is None else handle.size}")
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    if registry.get_hook(CFG_PARALLEL_HOOK) is not None:
        raise ValueError("CFG-parallel is already attached to this transformer")
    hook = CfgParallelHook(_Pair(handle, record))
    registry.register_hook(hook, CFG_PARALLEL_HOOK)
    return hook


def remove_cfg_parallel(transformer: torch.nn.Module) -> None:
    """Detach the pairing hook (no-op when absent); the transformer then computes every call again."""
    registry = getattr(transformer, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(CFG_PARALLEL_HOOK) is not None:
        registry.remove_hook(CFG_PARALLEL_HOOK, recurse=False)


@contextmanager
def cfg_parallel_hooks(transformers: list[torch.nn.Module], record: CfgParallelRecord,
                       config: CfgParallelConfig, site: str = "pipeline") -> Iterator[CfgParallelRecord]:
    """Around one pipeline call: audit the path, attach the hooks on the parallel path, detach them after.

    The audit entry is op ``cfg_parallel`` at ``site`` with the path that ran; a fallback lists ``cfg_parallel``
    as refused with the reason (strict mode does not raise here: the fallback computes the same clip).

    Raises:
        RuntimeError: the call ended with a pair half done (the pipeline called the transformer an odd number
            of times per step).
    """
    from metainfer_gen.kernels.audit_log import Refusal, record as audit_record

    parallel = record.path == CfgPath.PARALLEL.value
    audit_record(AUDIT_OP, site, record.path, () if parallel else (Refusal(AUDIT_OP, record.reason),))
    if not parallel:
        yield record
        return
    hooks = []
    try:
        for transformer in transformers:
            hooks.append(apply_cfg_parallel(transformer, record, config))
        yield record
        if any(hook.pair.pending is not None for hook in hooks):
            raise RuntimeError("the pipeline made an odd number of transformer calls: CFG-parallel needs a cond "
                               "and an uncond call per step")
    finally:
        for transformer in transformers:
            remove_cfg_parallel(transformer)
