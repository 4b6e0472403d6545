"""PCIe-aware collectives on torch.distributed: shared-memory fast paths on one host, audited backend fallback.

    torchrun --nproc-per-node 2 script.py
    # script.py
    from metainfer_gen import collectives
    collectives.init_distributed(tensor_parallel_size=2)   # gloo on CPU, NCCL on GPU; TP/CFG/DP groups
    collectives.all_reduce(x)                              # in place (sum): one-shot / two-shot / backend by size
    work = collectives.all_reduce(y, group="tp", async_op=True); ...; work.wait()
    collectives.all_gather(out, x); collectives.reduce_scatter(out, x)
    collectives.last_audit()                               # path taken, why, and what was refused
    collectives.shutdown_distributed()

Importing this package is cheap: the modules (which import torch) load on first attribute access.
"""

from __future__ import annotations

from metainfer_gen._lazy import lazy_exports

_EXPORTS = {
    "init_distributed": "metainfer_gen.collectives.distributed",
    "shutdown_distributed": "metainfer_gen.collectives.distributed",
    "get_state": "metainfer_gen.collectives.distributed",
    "is_initialized": "metainfer_gen.collectives.distributed",
    "launched_world_size": "metainfer_gen.collectives.distributed",
    "DistributedState": "metainfer_gen.collectives.distributed",
    "GroupHandle": "metainfer_gen.collectives.distributed",
    "all_reduce": "metainfer_gen.collectives.allreduce",
    "choose_algorithm": "metainfer_gen.collectives.allreduce",
    "all_gather": "metainfer_gen.collectives.gather",
    "reduce_scatter": "metainfer_gen.collectives.gather",
    "last_audit": "metainfer_gen.collectives.dispatch",
    "CollectiveRecord": "metainfer_gen.collectives.dispatch",
    "Work": "metainfer_gen.collectives.handles",
    "CollectiveTimeout": "metainfer_gen.collectives.shm",
    "CollectiveAborted": "metainfer_gen.collectives.shm",
    "Thresholds": "metainfer_gen.collectives.tuning",
    "gpu_links": "metainfer_gen.collectives.topology",
    "host_key": "metainfer_gen.collectives.topology",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
