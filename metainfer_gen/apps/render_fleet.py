"""Batch rendering through a fleet: ``metainfer-gen render --prompts FILE --out-dir DIR --job-store URL
--clips-dir SHARED``. Each prompt-file line becomes a job in the shared queue, rendered by whichever worker of the
fleet takes it; this process only submits, follows the fleet's progress (a progress bar) and copies each clip into
``DIR`` as its job finishes, recording it in ``manifest.jsonl`` (the same manifest as a local batch).

The job id is the line's idempotency key: ``video_batch_`` + the line's content id (prompt, seed, settings; see
:attr:`~.render.RenderJob.job_id`), so a rerun submits nothing twice (the store ignores an id it has) and copies
only the clips that are missing. Ctrl-C stops this process alone: the jobs stay queued and the fleet renders
them; the rerun picks up what they became.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from metainfer_gen.apps.render import BatchSummary, Manifest, RenderJob

POLL_S = 0.5  # how often the fleet's progress is read (one indexed SELECT per unfinished job)
ID_PREFIX = "video_batch_"


def request_checks(model: str | None, cache_names: tuple[str, ...]):
    """The checks a batch line passes before it is queued: the model's rules and defaults (read from its folder
    without loading weights); the size bounds are the model's, not a demo server's."""
    from metainfer_gen.apps.demo_limits import DemoLimits
    from metainfer_gen.serve.video.request import RequestChecks
    from metainfer_gen.serve.video.service import model_facts

    name, rules, defaults = model_facts(model)
    if rules is None:
        raise ValueError(f"--job-store needs a local model folder whose configs give its frame and size rules; "
                         f"{model!r} has none here")
    limits = DemoLimits(max_frames=100_001, max_size=100_000, max_steps=10_000, max_prompt_chars=100_000)
    return RequestChecks(limits, rules, defaults, name, cache_names, None, loading=False)


def _body(job: RenderJob, cache: str, fps: float | None) -> dict[str, Any]:
    if job.error:
        raise ValueError(job.error)
    if job.image is not None or job.loras:
        raise ValueError("image and lora lines are not rendered through --job-store yet: render them locally")
    body = {"prompt": job.prompt, "seed": job.seed, "cache": cache, **job.call}
    return body if fps is None else {**body, "fps": fps}


def _copy_clip(src: Path, dst: Path) -> None:
    """Copy the fleet's clip into the output folder atomically (temporary, fsync, rename)."""
    from metainfer_gen.video.export import durable_replace

    fd, tmp = tempfile.mkstemp(prefix=f".{dst.stem}.", suffix=dst.suffix, dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        durable_replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def render_through_fleet(jobs: list[RenderJob], out_dir: str | Path, store, clips_dir: str | Path, checks,
                         cache: str = "off", fps: float | None = None, progress: bool = True,
                         timeout_s: float | None = None) -> BatchSummary:
    """Queue every unfinished job in ``store`` and collect the clips the fleet writes to ``clips_dir``.

    Args:
        store: the fleet's :class:`~metainfer_gen.serve.video.jobs.JobStore`. checks: from :func:`request_checks`.
        cache: the step-cache spec of every job. fps: of the clips (None: the model's).
        timeout_s: give up waiting after this many seconds (None: wait for the fleet). The jobs stay queued.
    Returns:
        the counts (``rendered``: clips collected now).
    Raises:
        TimeoutError: ``timeout_s`` passed with jobs unfinished (the manifest holds what finished).
    """
    from tqdm.auto import tqdm

    from metainfer_gen.serve.errors import APIError
    from metainfer_gen.serve.video.jobs import JobStatus
    from metainfer_gen.serve.video.request import parse_video_request

    out_dir, clips_dir = Path(out_dir), Path(clips_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(out_dir)
    summary = BatchSummary(manifest=str(manifest.path))
    pending = [job for job in jobs if not manifest.finished(job, out_dir, ".mp4")]
    summary.skipped = len(jobs) - len(pending)
    waiting: dict[str, RenderJob] = {}
    for job in pending:
        record = {"job_id": job.job_id, "line": job.line, "prompt": job.prompt, "seed": job.seed, "image": job.image,
                  "settings": job.call, "path": job.name + ".mp4"}
        try:
            request = parse_video_request(_body(job, cache, fps), checks)
        except (ValueError, APIError) as exc:
            record.update(status="error", error=getattr(exc, "message", str(exc)), path=None, seed=None)
            summary.failed += 1
            manifest.write(jobs, record)
            continue
        store.add(ID_PREFIX + job.job_id, request.to_dict())  # a rerun's add of a known id changes nothing
        waiting[ID_PREFIX + job.job_id] = job
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tqdm(total=len(waiting), desc="fleet", unit="clip", disable=not progress) as bar:
        while waiting:
            for fleet_id, job in list(waiting.items()):
                row = store.get(fleet_id)
                if row is None or not row.status.finished:
                    continue
                record = {"job_id": job.job_id, "line": job.line, "prompt": job.prompt, "seed": job.seed,
                          "image": None, "settings": job.call, "path": job.name + ".mp4", "fleet_id": fleet_id,
                          "attempts": row.attempt, "seconds": row.render_seconds}
                if row.status is JobStatus.COMPLETED:
                    _copy_clip(clips_dir / f"{fleet_id}.mp4", out_dir / record["path"])
                    record.update(status="ok", settings={k: v for k, v in row.request.items() if k != "prompt"})
                    summary.rendered += 1
                else:
                    record.update(status="error", path=None, error=f"{row.status.value}: {row.error or ''}".strip())
                    summary.failed += 1
                    tqdm.write(f"line {job.line} {record['error']}", file=sys.stderr)
                manifest.write(jobs, record)
                del waiting[fleet_id]
                bar.update(1)
            if waiting and deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(waiting)} job(s) unfinished after {timeout_s} s; they stay queued")
            if waiting:
                time.sleep(POLL_S)
    if summary.skipped:
        manifest.write(jobs)
    return summary


def run_fleet_render(args, jobs: list[RenderJob]) -> int:
    """``render --prompts --job-store``'s body: checks the flags, opens the store, runs the batch; returns the exit
    code (130 after Ctrl-C, with the jobs left queued)."""
    import json

    from metainfer_gen.serve.video.stores import open_job_store
    from metainfer_gen.video.cache.policies import policy_names

    if args.clips_dir is None:
        raise ValueError("--job-store needs --clips-dir: the shared folder the fleet's workers write clips to")
    if args.format != "mp4":
        raise ValueError(f"the fleet writes MP4 clips: drop --format {args.format} or render locally")
    checks = request_checks(args.model, ("off", *policy_names()))
    store = open_job_store(args.job_store)
    try:
        summary = render_through_fleet(jobs, args.out_dir, store, args.clips_dir, checks, cache=args.cache,
                                       fps=args.fps)
    except KeyboardInterrupt:
        print("interrupted: the unfinished jobs stay queued in the fleet; rerun the same command to collect them",
              file=sys.stderr)
        return 130
    finally:
        store.close()
    print(json.dumps(summary.to_dict()))
    return 0 if summary.failed == 0 else 1
