"""Rendering on several processes under torchrun: the prompt file split over the data-parallel ranks, and
optionally each clip's CFG branches over a pair of ranks.

    torchrun --nproc-per-node 2 -m metainfer_gen.apps.cli render --prompts prompts.txt --out-dir clips/
    torchrun --nproc-per-node 4 -m metainfer_gen.apps.cli render --prompts prompts.txt --cfg-parallel   # 2 DP x 2 CFG
    torchrun --nproc-per-node 2 -m metainfer_gen.apps.cli render "a red circle" --cfg-parallel -o clip.mp4

Layout (``collectives.init_distributed``): with ``--cfg-parallel`` ranks ``2k`` and ``2k + 1`` render the same jobs,
one branch each, and rank ``2k`` saves them; the DP group (one rank per pair, or every rank without CFG) splits
the unfinished jobs round-robin (:class:`~metainfer_gen.apps.render.Shard`) and all of them merge their records
into the one ``manifest.jsonl`` under a file lock. Rank 0 prints the batch's totals; every rank exits with the
batch's status (1 when any job failed), so torchrun never stops a rank that is still rendering because another
finished its share with an error: the ranks wait for each other at the end on a gloo group whose timeout
(``METAINFER_RENDER_SYNC_TIMEOUT``, seconds, default 7 days) covers the longest share, not the collectives'
60 s. A rank that dies closes its sockets, and the others raise at once.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

from metainfer_gen.apps.render import BatchSummary, Shard

__all__ = ["DEFAULT_SYNC_TIMEOUT_S", "RenderRanks", "SYNC_TIMEOUT_ENV"]

SYNC_TIMEOUT_ENV = "METAINFER_RENDER_SYNC_TIMEOUT"
DEFAULT_SYNC_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(slots=True)
class RenderRanks:
    """This process in a multi-process render: its collectives state and the long-timeout barrier group.

    Attributes:
        state: the :class:`~metainfer_gen.collectives.distributed.DistributedState`.
        sync_group: a gloo group of every rank with ``SYNC_TIMEOUT_ENV``'s timeout, for the batch barriers.
    """

    state: Any
    sync_group: Any

    @classmethod
    def start(cls, cfg_parallel: bool, context_parallel: int = 1) -> "RenderRanks":
        """Initialise collectives from torchrun's environment (``cfg_parallel_size=2`` with ``cfg_parallel``,
        ``context_parallel_size=context_parallel``: ranks = DP x CFG x CP).

        Raises:
            ValueError: ``cfg_parallel`` with an odd world size, a world size that CFG x CP does not divide; a bad
                timeout value.
        """
        import torch.distributed as dist

        from metainfer_gen.collectives import init_distributed, launched_world_size

        world = launched_world_size()
        if cfg_parallel and world % 2:
            raise ValueError(f"--cfg-parallel pairs ranks; torchrun started {world}: use an even --nproc-per-node")
        per_clip = (2 if cfg_parallel else 1) * context_parallel
        if world % per_clip:
            raise ValueError(f"a clip takes {per_clip} ranks (CFG x context parallel); torchrun started {world}: use "
                             f"a multiple of {per_clip} for --nproc-per-node")
        raw = os.environ.get(SYNC_TIMEOUT_ENV, str(DEFAULT_SYNC_TIMEOUT_S))
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0:
            raise ValueError(f"environment variable {SYNC_TIMEOUT_ENV}={raw!r} must be a number of seconds > 0")
        state = init_distributed(cfg_parallel_size=2 if cfg_parallel else 1, context_parallel_size=context_parallel)
        group = dist.new_group(list(range(state.world_size)), backend="gloo",
                               timeout=datetime.timedelta(seconds=timeout_s))
        return cls(state, group)

    @property
    def is_main(self) -> bool:
        """Global rank 0: prints and saves what is written once."""
        return self.state.rank == 0

    @property
    def dp_size(self) -> int:
        return self.state.groups["dp"].size

    def barrier(self) -> None:
        """Return once every rank has called it (no short timeout: ranks may wait a whole share for each other)."""
        import torch.distributed as dist

        dist.barrier(group=self.sync_group)

    def shard(self) -> Shard:
        """This rank's part of the batch: its DP index, and whether it saves (CFG and CP rank 0) or only computes."""
        groups = self.state.groups
        return Shard(index=groups["dp"].rank, count=self.dp_size,
                     writes=groups["cfg"].rank == 0 and groups["cp"].rank == 0, sync=self.barrier)

    def totals(self, summary: BatchSummary) -> dict[str, Any]:
        """The batch's counts summed over the ranks (one all-gather), and what each rank rendered.

        Call it on every rank after :func:`~metainfer_gen.apps.render.render_batch` returned.
        """
        import torch

        from metainfer_gen.collectives import all_gather

        mine = torch.tensor([summary.rendered, summary.skipped, summary.failed], dtype=torch.int64,
                            device=self.state.device)
        rows = torch.empty(self.state.world_size, 3, dtype=torch.int64, device=mine.device)
        all_gather(rows, mine, group="world", site="render_ranks.totals")
        rows = rows.cpu().tolist()
        return {"rendered": sum(r[0] for r in rows), "skipped": sum(r[1] for r in rows),
                "failed": sum(r[2] for r in rows), "manifest": summary.manifest, "world_size": self.state.world_size,
                "data_parallel_size": self.dp_size, "cfg_parallel_size": self.state.cfg_parallel_size,
                "context_parallel_size": self.state.context_parallel_size,
                "rendered_per_rank": [r[0] for r in rows]}

    def close(self) -> None:
        """Release the shared memory and the process groups."""
        from metainfer_gen.collectives import shutdown_distributed

        shutdown_distributed()
