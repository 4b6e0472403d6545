"""Context parallelism for one clip: the video tokens split over the ranks of the CP group, attention by Ulysses.

    torchrun --nproc-per-node 2 script.py
    # script.py
    pipe = pipelines.TextToVideoPipeline.from_pretrained()
    pipe.enable_context_parallel(2)                    # init_distributed(context_parallel_size=2) under torchrun
    out = pipe("a red circle moving right", seed=0)    # the same clip on every rank
    out.stats.extra["context_parallel"]                # path, ranks, tokens per rank, attention

How. Diffusers (0.42) ships the pieces: a per-model plan (``WanTransformer3DModel._cp_plan``: split the image
tokens at ``blocks.0``, the rotary tables and Wan 2.2's per-token timesteps along the sequence; gather at
``proj_out``), the split/gather hooks (``diffusers.hooks.context_parallel.apply_context_parallel``) and the
attention (``TemplatedUlyssesAttention``: an all-to-all turns each rank's tokens x all heads into all tokens x its
heads, attention runs locally, a second all-to-all turns it back; exact, no softmax merging). Its entry point,
``ModelMixin.enable_parallelism``, does not run here: it builds a mesh over the whole world and divides by
``torch.accelerator.device_count()``, which is 0 on the CPU. So the mesh and the ``ParallelConfig`` are built here,
over this job's CP groups (inside a CFG pair and a data-parallel shard: ranks = DP x CFG x CP), for gloo on the CPU
and NCCL on GPUs. Ring attention is not used: diffusers' native (CPU) attention returns no log-sum-exp, which ring
needs. The hooks are attached for the length of one pipeline call, after any step cache (so the cache sees this
rank's shard) and inside CFG-parallel's pairing hook.

With the step cache, the signal terms each rank measures on its shard are summed over the CP group
(:func:`~metainfer_gen.video.cache.apply.set_step_cache_reduction`) before each decision, so every rank reuses
or computes the same steps; the cached residuals stay sharded. Sources followed: xDiT (xfuser) USP, whose
Ulysses half this is, and cache-dit's rule that a cache under sequence parallelism must decide from all shards.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch

from metainfer_gen.video.rank_agreement import group_handle

__all__ = ["AUDIT_OP", "ContextParallelConfig", "ContextParallelRecord", "connect_cp_group", "context_parallel_hooks",
           "plan_context_parallel", "prepare_context_parallel", "token_count"]

AUDIT_OP = "context_parallel"


@dataclass(slots=True)
class ContextParallelConfig:
    """Settings of context parallelism for one clip.

    Attributes:
        size: ranks that share one clip's tokens (>= 2); the heads and the token count must divide by it.
        group: the :mod:`metainfer_gen.collectives` group of those ranks ("cp").
    Raises:
        ValueError: a size below 2 or not an int.
    """

    size: int
    group: str = "cp"
    prepared: Any = field(default=None, repr=False)  # the diffusers ParallelConfig, once built

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 2:
            raise ValueError(f"context-parallel size must be an int >= 2 (ranks sharing one clip); got {self.size!r}")


@dataclass(slots=True)
class ContextParallelRecord:
    """What one call did (``out.stats.extra["context_parallel"]``): ``rank``/``size`` in the CP group, the
    clip's ``num_tokens`` and this rank's share, and the attention used."""

    rank: int
    size: int
    num_tokens: int
    tokens_per_rank: int
    attention: str = "ulysses all-to-all (diffusers TemplatedUlyssesAttention)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def connect_cp_group(config: ContextParallelConfig, cfg_parallel: bool = False) -> None:
    """Initialise collectives with ``context_parallel_size=config.size`` (and ``cfg_parallel_size=2`` with
    ``cfg_parallel``) when torchrun started the ranks and nobody initialised them; check the CP group's size.

    Raises:
        ValueError: one process (CP needs torchrun), a world size that ``size`` (x 2 with CFG) does not divide, or
            collectives initialised with another CP size.
    """
    from metainfer_gen.collectives import distributed

    if not distributed.is_initialized():
        world = distributed.launched_world_size()
        grid = config.size * (2 if cfg_parallel else 1)
        if world == 1:
            raise ValueError(f"context parallelism splits one clip over {config.size} ranks, but this is one "
                             f"process: launch with torchrun --nproc-per-node {grid}")
        if world % grid:
            raise ValueError(f"WORLD_SIZE={world} is not a multiple of {config.size} context-parallel ranks"
                             f"{' x 2 CFG branches' if cfg_parallel else ''}; use --nproc-per-node {grid}")
        distributed.init_distributed(cfg_parallel_size=2 if cfg_parallel else 1, context_parallel_size=config.size)
    handle = group_handle(config.group)
    if handle.size != config.size:
        raise ValueError(f"the {config.group!r} group has {handle.size} ranks, not {config.size}: collectives were "
                         f"initialised without context_parallel_size={config.size} (with CFG-parallel too, call "
                         f"enable_context_parallel({config.size}, cfg_parallel=True) instead of enable_cfg_parallel())")


def prepare_context_parallel(transformers: list[torch.nn.Module], config: ContextParallelConfig):
    """Check every transformer can be split ``config.size`` ways and build diffusers' ``ParallelConfig`` once.

    Collective: every rank of the job must call it at the same point (it creates the mesh's process groups).
    Returns:
        the ``diffusers.models._modeling_parallel.ParallelConfig`` (also kept in ``config.prepared``).
    Raises:
        ValueError: a transformer without a diffusers context-parallel plan (``_cp_plan``), or whose
            ``num_attention_heads`` the size does not divide (Ulysses gives each rank whole heads).
    """
    if config.prepared is not None:
        return config.prepared
    from diffusers import ContextParallelConfig as DiffusersCP
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import DeviceMesh

    from metainfer_gen.collectives.distributed import get_state

    for model in transformers:
        name = type(model).__name__
        if getattr(model, "_cp_plan", None) is None:
            raise ValueError(f"{name} has no context-parallel plan in diffusers (_cp_plan): it cannot split its tokens")
        heads = getattr(model.config, "num_attention_heads", None)
        if heads is None or heads % config.size:
            divisors = [d for d in range(2, (heads or 0) + 1) if heads % d == 0]
            raise ValueError(f"Ulysses attention gives each rank whole heads: {name} has num_attention_heads={heads},"
                             f" not divisible by {config.size} ranks; use a size in {divisors or 'none'}")
    state, handle = get_state(), group_handle(config.group)
    tp = state.tensor_parallel_size
    # Rank layout (collectives.distributed): rank = ((dp * cfg + c) * cp + s) * tp + t; one mesh row per CP group.
    ranks = torch.arange(state.world_size).reshape(-1, config.size, tp).transpose(1, 2).reshape(-1, 1, config.size)
    if not any(tuple(row[0].tolist()) == handle.ranks for row in ranks):
        raise ValueError(f"the {config.group!r} group {handle.ranks} is not a context-parallel group of the layout")
    mesh = DeviceMesh(state.device.type, ranks, mesh_dim_names=("outer", "ring", "ulysses"))
    diffusers_config = DiffusersCP(ulysses_degree=config.size, mesh=mesh)
    prepared = ParallelConfig(context_parallel_config=diffusers_config)
    prepared.setup(state.rank, state.world_size, state.device, mesh=mesh)
    config.prepared = prepared
    return prepared


def token_count(pipe, num_frames: int, height: int, width: int) -> int:
    """Image tokens of one clip in the transformer: latent frames x latent rows x columns over the patch size."""
    transformer = getattr(pipe, "transformer", None) or pipe.transformer_2
    pt, ph, pw = transformer.config.patch_size
    frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
    spatial = pipe.vae_scale_factor_spatial
    return (frames // pt) * (height // spatial // ph) * (width // spatial // pw)


def plan_context_parallel(config: ContextParallelConfig, pipe, num_frames: int, height: int,
                          width: int) -> ContextParallelRecord:
    """The coming call's split, checked before any work (no communication).

    Raises:
        ValueError: the clip's token count does not divide by the size (the error names the count and the size),
            or the pipeline is not on this rank's device.
    """
    from metainfer_gen.collectives.distributed import get_state

    tokens = token_count(pipe, num_frames, height, width)
    if tokens % config.size:
        raise ValueError(f"context parallelism splits the clip's {tokens} tokens ({num_frames} frames at "
                         f"{height}x{width}) over {config.size} ranks, which does not divide them: choose frames or "
                         f"a size whose token count is a multiple of {config.size}")
    handle, state = group_handle(config.group), get_state()
    if state.backend == "nccl" and torch.device(str(pipe.device)) != state.device:
        raise ValueError(f"the pipeline is on {pipe.device} but this rank computes on {state.device}: load it with "
                         "device=str(collectives.get_state().device)")
    return ContextParallelRecord(handle.rank, handle.size, tokens, tokens // config.size)


def _set_processors(model: torch.nn.Module, parallel_config) -> None:
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = parallel_config


@contextmanager
def context_parallel_hooks(transformers: list[torch.nn.Module], config: ContextParallelConfig,
                           record: ContextParallelRecord, site: str = "pipeline") -> Iterator[ContextParallelRecord]:
    """Around one pipeline call: diffusers' split/gather hooks and Ulysses attention on every transformer, the step
    cache's signal summed over the CP group; everything detached after (the model then computes alone again).

    The audit entry is op ``context_parallel`` at ``site``.
    """
    from diffusers.hooks.context_parallel import apply_context_parallel, remove_context_parallel

    from metainfer_gen.collectives import all_reduce
    from metainfer_gen.kernels.audit_log import record as audit_record
    from metainfer_gen.video.cache.apply import set_step_cache_reduction

    prepared = config.prepared
    handle = group_handle(config.group)
    audit_record(AUDIT_OP, site, "ulysses", ())

    def reduce(terms: torch.Tensor) -> None:
        all_reduce(terms, group=handle, site="context_parallel.step_cache_signal")

    attached = []
    try:
        for model in transformers:
            apply_context_parallel(model, prepared.context_parallel_config, model._cp_plan)
            attached.append(model)
            _set_processors(model, prepared)
            set_step_cache_reduction(model, reduce)
        yield record
    finally:
        for model in attached:
            remove_context_parallel(model, model._cp_plan)
            _set_processors(model, None)
            set_step_cache_reduction(model, None)
