"""``metainfer-gen video-worker``: a worker-only node of a video fleet: no HTTP, just worker processes taking jobs
from the shared queue and writing clips to the shared folder, until SIGTERM or Ctrl-C.

    metainfer-gen video-worker --job-store postgresql://db-host/jobs --clips-dir /mnt/clips --workers 2

A job left running when the node stops (or dies) goes back to the queue when its lease expires; any other node
then renders it (docs/fleet.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from metainfer_gen.apps.arg_types import positive_int
from metainfer_gen.apps.fleet_args import add_job_store_arguments


def add_video_worker_parser(subparsers) -> None:
    """Register the ``video-worker`` subcommand on the CLI's subparsers."""
    p = subparsers.add_parser("video-worker", help="render video jobs from a shared job store (a worker-only "
                                                   "node of a fleet; no HTTP)",
                              description="Start worker processes that take jobs from --job-store and write clips "
                                          "to --clips-dir until stopped (SIGTERM, Ctrl-C). Pair with `serve "
                                          "--video-workers 0` nodes, or with ordinary `serve` nodes.")
    add_job_store_arguments(p, role="video-worker")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="worker processes, each loading the model once: one per GPU; on the CPU the cores are "
                        "split between them (default 1)")
    p.add_argument("--video", default=None, help="video pipeline folder or hub id (default: the embedded model; "
                                                 "every node of a fleet must serve the same one)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads per worker (default: the usable cores / --workers)")
    p.add_argument("--video-device", default=None,
                   help="the workers' device (default: GPU i for worker i when CUDA is available, else cpu)")
    p.set_defaults(func=cmd_video_worker)


def cmd_video_worker(args: argparse.Namespace) -> int:
    from metainfer_gen.serve.video.stores import open_job_store, store_scheme
    from metainfer_gen.serve.video.worker import UPLOADS, WorkerSpec
    from metainfer_gen.serve.video.worker_pool import WorkerPool, node_name, usable_cores

    store_scheme(args.job_store)  # an unknown scheme is a ValueError: the CLI prints it
    clips = Path(args.clips_dir).resolve()
    (clips / UPLOADS).mkdir(parents=True, exist_ok=True)
    try:
        store = open_job_store(args.job_store, args.lease_seconds, args.max_attempts)
    except (ImportError, RuntimeError) as exc:  # no psycopg; unreachable; schema too new
        print(f"error: {exc}", file=sys.stderr)
        return 2
    node, threads = node_name(), args.threads or max(1, usable_cores() // args.workers)

    def spec(index: int) -> WorkerSpec:
        return WorkerSpec(index, args.job_store, str(clips), str(clips / UPLOADS), f"{node}/{index}", args.video,
                          args.video_device, None, threads, os.getpid(), args.lease_seconds, args.max_attempts)

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    pool = WorkerPool(spec, args.workers, store).start()
    try:
        reported = False
        while not stop.wait(0.5):
            if not reported and pool.num_ready == args.workers:
                print(f"video-worker {node}: {args.workers} worker(s) ready on {_shown(args.job_store)}", flush=True)
                reported = True
            if pool.all_exited:
                print("error: every worker process exited", file=sys.stderr)
                return 1
    finally:
        pool.close()
        store.close()
    return 0


def _shown(address: str) -> str:
    if address.startswith(("postgresql://", "postgres://")):
        from metainfer_gen.serve.video.postgres_store import describe

        return describe(address)
    return address
