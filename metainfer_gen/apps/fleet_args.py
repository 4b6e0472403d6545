"""The job-store flags shared by ``serve`` and ``video-worker``: where the queue is (``--job-store``), where clips
go (``--clips-dir``), and how long a claim holds without a heartbeat (``--lease-seconds``, ``--max-attempts``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from metainfer_gen.apps.arg_types import positive_float, positive_int


def add_job_store_arguments(p: argparse.ArgumentParser, required: bool = False) -> None:
    """Add the store flags to ``p`` (``required``: ``--job-store`` and ``--clips-dir`` must be given)."""
    from metainfer_gen.serve.video.jobs import DEFAULT_LEASE_S, DEFAULT_MAX_ATTEMPTS

    p.add_argument("--job-store", required=required, default=None,
                   help="the video job queue: postgresql://user@host:port/dbname, shared by every machine of a "
                        "fleet (needs the fleet extra), or a SQLite file (one machine)"
                        + ("" if required else "; default: SQLite in --data-dir"))
    p.add_argument("--clips-dir", type=Path, required=required, default=None,
                   help="folder of the clips and uploaded images; with a shared --job-store, a folder every machine "
                        "mounts (NFS)" + ("" if required else " (default: inside --data-dir)"))
    p.add_argument("--lease-seconds", type=positive_float, default=DEFAULT_LEASE_S,
                   help=f"how long a claimed job stays with a worker that stopped sending heartbeats before another "
                        f"machine takes it over (default {DEFAULT_LEASE_S:g})")
    p.add_argument("--max-attempts", type=positive_int, default=DEFAULT_MAX_ATTEMPTS,
                   help=f"claims a job may take (each lost lease spends one) before it fails "
                        f"(default {DEFAULT_MAX_ATTEMPTS})")


def job_store_options(args: argparse.Namespace) -> dict:
    """The ``VideoServeConfig`` fields of the parsed store flags."""
    return {"job_store": args.job_store, "clips_dir": args.clips_dir, "lease_s": args.lease_seconds,
            "max_attempts": args.max_attempts}
