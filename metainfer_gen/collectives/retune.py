"""Re-measure this machine's all-reduce thresholds (:mod:`metainfer_gen.collectives.tuning`) with local ranks::

    python -m metainfer_gen.collectives.retune --world-size 2
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from metainfer_gen.collectives import distributed
from metainfer_gen.collectives.tuning import cache_path, load_or_measure, machine_key


def _tune_worker(rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    state = distributed.init_distributed(tune=False)
    try:
        world = state.groups["world"]
        t = load_or_measure(world.comm, world.group, force=True)
        if rank == 0:
            print(json.dumps(asdict(t), indent=1))
            print(f"written to {cache_path()} under {machine_key(world_size)!r}")
    finally:
        distributed.shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    """Re-measure the thresholds with ``--world-size`` local processes and rewrite the cache entry."""
    parser = argparse.ArgumentParser(prog="python -m metainfer_gen.collectives.retune", description=main.__doc__)
    parser.add_argument("--world-size", type=int, default=2, help="number of local ranks to measure with")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be >= 2")
    import torch.multiprocessing as mp

    mp.spawn(_tune_worker, args=(args.world_size, distributed.free_port()), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
