"""The video flags of ``metainfer-gen serve`` (``--video``, ``--video-workers``, ``--data-dir``, ``--lora-dir``, ...)
and the :class:`~metainfer_gen.serve.video.service.VideoServeConfig` they make, with the demo's limits."""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

from metainfer_gen.apps.arg_types import non_negative_int, positive_int
from metainfer_gen.apps.fleet_args import add_job_store_arguments, job_store_options
from metainfer_gen.apps.video_args import PRESET_NAMES
from metainfer_gen.apps.demo_limits import DemoLimits, check_lora

NONE = "none"
AUTO = "auto"
CORES_PER_CPU_WORKER = 2  # a CPU worker's threads: one clip's OpenMP team, without idling at barriers


def workers_count(text: str) -> int | str:
    """``--video-workers``: an integer >= 0, or ``"auto"`` (sized by :func:`auto_video_workers` at start)."""
    return AUTO if text.strip().lower() == AUTO else non_negative_int(text)


def auto_video_workers(num_gpus: int, num_cores: int) -> int:
    """``--video-workers auto``: one worker per GPU; with none, one per :data:`CORES_PER_CPU_WORKER` usable cores
    (at least one)."""
    return num_gpus if num_gpus > 0 else max(1, num_cores // CORES_PER_CPU_WORKER)


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/metainfer-gen/videos`` (default ``~/.local/share/metainfer-gen/videos``)."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "metainfer-gen" / "videos"


def add_video_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Add the video flags to the ``serve`` parser."""
    limits = DemoLimits()
    p.add_argument("--video", default=None,
                   help="video pipeline folder or hub id to serve on /v1/videos (default: the embedded model; "
                        "'none': no video routes)")
    p.add_argument("--video-workers", type=workers_count, default=1,
                   help="video worker processes, each loading the model once: one per GPU; on the CPU the cores "
                        "are split between them; 'auto': one per visible GPU, else one per "
                        f"{CORES_PER_CPU_WORKER} usable cores; 0: an API-only node whose jobs the fleet's workers "
                        "render (default 1)")
    p.add_argument("--preset", choices=PRESET_NAMES, default=None,
                   help="each video worker's pipe.enable_acceleration preset (quality, balanced, fastest); a "
                        "request's cache 'off' then runs the preset's step cache (default: none)")
    p.add_argument("--video-threads", type=positive_int, default=None,
                   help="CPU threads per video worker (default: the usable cores / --video-workers)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"folder of the local video job store (SQLite), clips and uploads; jobs survive restarts "
                        f"(default {default_data_dir()})")
    add_job_store_arguments(p)
    p.add_argument("--lora-dir", type=Path, default=None,
                   help="folder whose LoRA files requests may name in 'lora' (names only, never paths; default: "
                        "the embedded model's LoRAs when serving it, else none)")
    p.add_argument("--video-device", default=None,
                   help="the video workers' device (default: GPU i for worker i when CUDA is available, else cpu)")
    p.add_argument("--max-upload-mb", type=positive_int, default=limits.max_upload_mb,
                   help=f"largest multipart request (the reference image), MiB (default {limits.max_upload_mb})")
    for name, help_text in (("max_frames", "frames per clip"), ("max_size", "height and width, pixels"),
                            ("max_steps", "denoising steps")):
        p.add_argument(f"--video-{name.replace('_', '-')}", dest=f"video_{name}", type=positive_int,
                       default=getattr(limits, name), help=f"largest {help_text} a request may ask for "
                                                           f"(default {getattr(limits, name)}, the demo's)")


def video_serve_config(args: argparse.Namespace):
    """The ``VideoServeConfig`` of the parsed flags, or None for ``--video none``.

    Raises:
        FileNotFoundError: a ``--video`` that is neither a pipeline folder nor a hub id, or a ``--lora-dir``
            that is not a folder.
    """
    from metainfer_gen.pipelines.loading import default_lora_dir, resolve_model_source
    from metainfer_gen.serve.video.service import VideoServeConfig

    if args.video == NONE:
        return None
    if args.video is not None:
        resolve_model_source(args.video)  # a missing folder or a bare name fails here, not in every worker
    lora_dir = args.lora_dir if args.lora_dir is not None else (default_lora_dir() if args.video is None else None)
    if lora_dir is not None and not Path(lora_dir).is_dir():
        raise FileNotFoundError(f"--lora-dir {lora_dir} is not a folder")
    limits = DemoLimits(max_frames=args.video_max_frames, max_size=args.video_max_size,
                        max_steps=args.video_max_steps, max_upload_mb=args.max_upload_mb)
    lora = None if lora_dir is None else functools.partial(check_lora, lora_dir)
    return VideoServeConfig(data_dir=args.data_dir or default_data_dir(), limits=limits, model=args.video,
                            num_workers=_num_workers(args.video_workers), num_threads=args.video_threads,
                            device=args.video_device, lora=lora, max_upload_bytes=args.max_upload_mb << 20,
                            preset=args.preset, **job_store_options(args))


def _num_workers(value: int | str) -> int:
    if value != AUTO:
        return value
    import torch

    from metainfer_gen.serve.video.worker_pool import usable_cores

    return auto_video_workers(torch.cuda.device_count() if torch.cuda.is_available() else 0, usable_cores())
