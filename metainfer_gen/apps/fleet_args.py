"""The job-store flags shared by ``serve``, ``video-worker`` and ``render``: where the queue is (``--job-store``),
where clips go (``--clips-dir``), and, for the processes that claim jobs, how long a claim holds without a heartbeat
(``--lease-seconds``, ``--max-attempts``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from metainfer_gen.apps.arg_types import positive_float, positive_int

_STORE_HELP = {
    "serve": "; default: SQLite in --data-dir",
    "video-worker": "",
    "render": "; with --prompts, the batch is queued there and rendered by the fleet's workers",
}
_CLIPS_HELP = {"serve": " (default: inside --data-dir)", "video-worker": "",
               "render": " (where this command collects them from)"}


def add_job_store_arguments(p: argparse.ArgumentParser, role: str = "serve") -> None:
    """Add the store flags to ``p`` for ``role`` ("serve", "video-worker": both flags required, or "render": no
    lease flags)."""
    from metainfer_gen.serve.video.jobs import DEFAULT_LEASE_S, DEFAULT_MAX_ATTEMPTS

    required = role == "video-worker"
    p.add_argument("--job-store", required=required, default=None,
                   help="the video job queue: postgresql://user@host:port/dbname, shared by every machine of a "
                        "fleet (needs the fleet extra), or a SQLite file (one machine)" + _STORE_HELP[role])
    p.add_argument("--clips-dir", type=Path, required=required, default=None,
                   help="folder of the clips and uploaded images; with a shared --job-store, a folder every machine "
                        "mounts (NFS)" + _CLIPS_HELP[role])
    if role == "render":
        return
    p.add_argument("--lease-seconds", type=positive_float, default=DEFAULT_LEASE_S,
                   help=f"how long a claimed job stays with a worker that stopped sending heartbeats before another "
                        f"machine takes it over (default {DEFAULT_LEASE_S:g})")
    p.add_argument("--max-attempts", "--max-job-attempts", dest="max_attempts", type=positive_int,
                   default=DEFAULT_MAX_ATTEMPTS,
                   help=f"claims a job may take (each lost lease, each worker process that dies running it, each "
                        f"server stopped under it spends one) before it fails (default {DEFAULT_MAX_ATTEMPTS})")


def job_store_options(args: argparse.Namespace) -> dict:
    """The ``VideoServeConfig`` fields of the parsed store flags."""
    return {"job_store": args.job_store, "clips_dir": args.clips_dir, "lease_s": args.lease_seconds,
            "max_attempts": args.max_attempts}
