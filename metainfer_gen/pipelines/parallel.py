"""One clip on several ranks: CFG-parallel (the two guidance branches on two ranks) and context parallelism (the
clip's tokens split over N ranks), alone or composed (ranks = CFG x CP), around each call of the video pipelines."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator


class ParallelMixin:
    """Methods of :class:`~metainfer_gen.pipelines.video_base.VideoPipelineBase` (needs ``transformers`` and
    ``diffusers_pipeline``; sets ``cfg_parallel`` and ``context_parallel``)."""

    cfg_parallel = None  # the video.cfg_parallel.CfgParallelConfig when enabled, or None
    cfg_batch = False  # both CFG branches in one forward per step (video.cfg_batch), where CFG-parallel is off
    context_parallel = None  # the video.context_parallel.ContextParallelConfig when enabled, or None

    def enable_cfg_parallel(self, config: Any = None) -> None:
        """Run the conditional and unconditional transformer passes of each step on two ranks (under torchrun).

        Every rank runs the same script and makes the same calls; each computes one branch per step, the two
        exchange their noise predictions (one all-gather per step) and all end with the same latents and clip.
        Calls with ``guidance_scale <= 1``, in a one-process world, or on a pipeline that batches its branches run
        the ordinary way; ``out.stats.extra["cfg_parallel"]`` and the audit (op ``cfg_parallel``) say which path
        ran and why. See :mod:`metainfer_gen.video.cfg_parallel`. Example (``torchrun --nproc-per-node 2``)::

            pipe = pipelines.TextToVideoPipeline.from_pretrained()
            pipe.enable_cfg_parallel()
            out = pipe("a red circle moving right", guidance_scale=5.0, seed=0)

        Args:
            config: a ``video.cfg_parallel.CfgParallelConfig`` (default: the ``"cfg"`` group). When torchrun
                started several ranks and collectives are not initialised yet, this initialises them with
                ``cfg_parallel_size=2``; on NCCL, load the pipeline with
                ``device=str(collectives.get_state().device)``. With context parallelism as well, use
                ``enable_context_parallel(N, cfg_parallel=True)``.
        Raises:
            ValueError: an odd world size, or a CFG group of more than two ranks. TypeError: a wrong config type.
        """
        from metainfer_gen.video.cfg_parallel import CfgParallelConfig, connect_cfg_group

        config = CfgParallelConfig() if config is None else config
        if not isinstance(config, CfgParallelConfig):
            raise TypeError(f"config must be a CfgParallelConfig; got {type(config).__name__}")
        connect_cfg_group(config)
        self.cfg_parallel = config

    def enable_cfg_batch(self) -> None:
        """Run the conditional and unconditional transformer passes of each step as one forward of twice the
        batch (one process; a rank with CFG-parallel on keeps that instead). Guided calls on the Wan pipelines
        batch; ``out.stats.extra["cfg_batch"]`` and the audit (op ``cfg_batch``) say which path ran and why. The
        clip equals the unbatched one within GEMM rounding. See :mod:`metainfer_gen.video.cfg_batch`."""
        self.cfg_batch = True

    def disable_cfg_batch(self) -> None:
        """Two transformer calls per guided step again."""
        self.cfg_batch = False

    def disable_cfg_parallel(self) -> None:
        """Compute both CFG branches on every rank again (collectives stay initialised)."""
        self.cfg_parallel = None

    def enable_context_parallel(self, size: Any, cfg_parallel: bool = False) -> None:
        """Split each clip's video tokens over ``size`` ranks (under torchrun): every rank computes its share of
        every block, attention exchanges heads and tokens (Ulysses all-to-all, diffusers' own), and all ranks end
        with the same latents and clip. See :mod:`metainfer_gen.video.context_parallel`.

        Example (``torchrun --nproc-per-node 4``: 2 CFG x 2 CP)::

            pipe = pipelines.TextToVideoPipeline.from_pretrained()
            pipe.enable_context_parallel(2, cfg_parallel=True)
            out = pipe("a red circle moving right", guidance_scale=5.0, seed=0)
            out.stats.extra["context_parallel"]   # rank, size, tokens per rank

        Args:
            size: ranks per clip's tokens (an int >= 2, or a ``video.context_parallel.ContextParallelConfig``).
                The transformer's attention heads must divide by it, and each call's token count too (checked
                before any work). When collectives are not initialised yet this initialises them with
                ``context_parallel_size=size`` (and ``cfg_parallel_size=2``); collective: call it on every rank.
            cfg_parallel: also split the guidance branches over pairs of CP groups (ranks = 2 x size).
        Raises:
            ValueError: one process (launch with torchrun), a world size that does not fit, a model without a
                diffusers context-parallel plan, heads not divisible by ``size``, or CP already enabled.
        """
        from metainfer_gen.video.context_parallel import ContextParallelConfig, connect_cp_group, \
            prepare_context_parallel

        if self.context_parallel is not None:
            raise ValueError("context parallelism is already enabled; call disable_context_parallel() first")
        config = size if isinstance(size, ContextParallelConfig) else ContextParallelConfig(size)
        connect_cp_group(config, cfg_parallel=cfg_parallel)
        prepare_context_parallel(self.transformers, config)
        if cfg_parallel:
            self.enable_cfg_parallel()
        self.context_parallel = config

    def disable_context_parallel(self) -> None:
        """Compute every clip's tokens on each rank again (collectives stay initialised)."""
        self.context_parallel = None

    def _parallel_session(self, call_kwargs: dict[str, Any], seed: int | None, generator):
        """(context manager around the diffusers call yielding ``{name: record}``, seed to use): the paths
        decided and checked before any work, and every rank of the clip agreed on the call and the seed."""
        from metainfer_gen.video.rank_agreement import agree_on_call, call_fingerprint, group_handle

        site = f"{type(self).__name__}.__call__"
        sessions, given = [], seed is not None
        fingerprint = call_fingerprint({**call_kwargs, "seed": seed}) if self.cfg_parallel or self.context_parallel \
            else None
        if self.context_parallel is not None:
            from metainfer_gen.video.context_parallel import context_parallel_hooks, plan_context_parallel

            config = self.context_parallel
            record = plan_context_parallel(config, self.diffusers_pipeline, call_kwargs["num_frames"],
                                           call_kwargs["height"], call_kwargs["width"])
            seed = agree_on_call(group_handle(config.group), fingerprint, seed, generator is not None,
                                 "context-parallel")
            sessions.append(("context_parallel", context_parallel_hooks(self.transformers, config, record, site)))
        if self.cfg_parallel is not None:  # outside the CP hooks: it pairs whole transformer calls
            from metainfer_gen.video.cfg_parallel import cfg_parallel_hooks, plan_cfg_parallel

            record = plan_cfg_parallel(self.cfg_parallel, self.diffusers_pipeline, call_kwargs.get("guidance_scale"))
            # After a context-parallel draw each CP group holds its own seed; the CFG group's rank 0 (in the first
            # branch's CP group) decides, so every rank of the CFG x CP grid ends with that one.
            seed = agree_on_call(group_handle(self.cfg_parallel.group), fingerprint, seed, generator is not None,
                                 "CFG-parallel", drawn=not given)
            sessions.append(("cfg_parallel", cfg_parallel_hooks(self.transformers, record, self.cfg_parallel, site)))
        elif self.cfg_batch:  # registered last: outside every cache and CP hook, like CFG-parallel's
            from metainfer_gen.video.cache.policy import StepCachePolicy
            from metainfer_gen.video.cfg_batch import cfg_batch_hooks, plan_cfg_batch

            cache = self.step_cache
            baseline = None if cache is None or isinstance(cache, StepCachePolicy) else cache.name
            record = plan_cfg_batch(self.diffusers_pipeline, call_kwargs.get("guidance_scale"),
                                    self.context_parallel is not None, baseline)
            sessions.append(("cfg_batch", cfg_batch_hooks(self.transformers, record, site)))

        @contextmanager
        def session() -> Iterator[dict[str, Any]]:
            with ExitStack() as stack:
                yield {name: stack.enter_context(manager) for name, manager in sessions}

        return session(), seed

    @staticmethod
    def _parallel_stats(stats, records: dict[str, Any]) -> None:
        """Add the parallel paths' records to a call's stats (a CFG rank's skipped calls do not count)."""
        cfg = records.get("cfg_parallel")
        if cfg is not None:
            stats.transformer_calls -= cfg.num_skipped_calls
        batch = records.get("cfg_batch")
        if batch is not None:  # each batched step's first call returned at once
            stats.transformer_calls -= batch.num_batched_steps
        for name, record in records.items():
            stats.extra[name] = record.to_dict()
