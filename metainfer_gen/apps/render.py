"""Batch rendering from a prompt file, with a manifest, atomic clips and resume.

The prompt file holds one job per line: a JSON object (``{"prompt": ..., "seed": 3, "num_frames": 17,
"image": "ref.png", "name": "intro", "lora": ["style.safetensors:0.8"]}``) or plain text (the prompt). Blank
lines and lines starting with ``#`` are skipped. Each job gets a stable id from its content, so rerunning the
same command skips every clip already finished (file present and recorded in the manifest) and retries the rest;
a bad line or a failing clip is recorded with its error and the batch goes on. ``manifest.jsonl`` holds one
line per job, rewritten atomically after each job, in prompt-file order. A line's ``lora`` (or the CLI's
``--lora``) LoRAs are swapped in per job on the one loaded model, and recorded with the job.

Several processes (torchrun, see :mod:`metainfer_gen.apps.render_ranks`) share one batch through a :class:`Shard`
each: they all read the manifest at the start, split the unfinished jobs round-robin (process ``i`` of ``n`` takes
unfinished jobs ``i, i + n, ...``), and merge each record into the one ``manifest.jsonl`` under an exclusive
``flock`` on ``.render.lock`` in the output folder (re-read, update, atomic rename). Per-rank part files merged at
the end were the alternative; the shared file was chosen because it is complete at every moment: a kill loses no
finished clip, and a rerun with any number of processes (one included) resumes from it unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from metainfer_gen.video.export import umask_mode

MANIFEST = "manifest.jsonl"
TMP_MANIFEST_PREFIX = ".manifest."
LOCK_NAME = ".render.lock"  # flocked by processes sharing the manifest; removed when their batch ends
FORMATS = ("mp4", "gif", "png")
_CALL_KEYS = ("negative_prompt", "num_frames", "height", "width", "num_inference_steps", "guidance_scale")
_LINE_KEYS = {"prompt", "seed", "image", "name", "lora", *_CALL_KEYS}


@dataclass(slots=True)
class RenderJob:
    """One line of a prompt file, resolved.

    Attributes:
        line: 1-based line number in the prompt file. prompt: the text. seed: integer seed.
        image: reference image path for image-to-video, else None. name: output stem.
        call: call arguments given on the line (num_frames, height, ...); the rest come from the CLI/model.
        error: why the line could not be parsed (the job is then recorded, never rendered).
        loras: ``(absolute LoRA path, weight)`` pairs active for this job (the line's ``lora`` field, else the
            defaults given to :func:`parse_prompt_file`).
    """

    line: int
    prompt: str = ""
    seed: int = 0
    image: str | None = None
    name: str = ""
    call: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    loras: list[tuple[str, float]] = field(default_factory=list)

    @property
    def job_id(self) -> str:
        """Stable id from everything that determines the clip, not its file name or line (a bad line: its error)."""
        parts: list[Any] = [self.prompt, self.seed, self.image, sorted(self.call.items())]
        if self.loras:  # only then: ids of jobs without LoRAs stay those of earlier versions (resume works)
            parts.append([list(spec) for spec in self.loras])
        if self.error is not None:
            parts.append(self.error)  # bad lines keep apart: most have no prompt, so little else differs
        key = json.dumps(parts, default=str)
        return hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_lora_spec(text: str, base_dir: str | Path | None = None) -> tuple[str, float]:
    """``"path[:weight]"`` -> (absolute path, weight); weight 1.0 when omitted. Relative paths resolve against
    ``base_dir`` (default: the working directory).

    Raises:
        ValueError: empty text or a weight that is not a finite number.
        FileNotFoundError: the LoRA file or folder does not exist (checked before any model is loaded).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a LoRA is given as 'path' or 'path:weight'; got {text!r}")
    path, weight = text.strip(), 1.0
    head, sep, tail = path.rpartition(":")
    if sep and head and not Path(path).exists():
        try:
            weight = float(tail)
        except ValueError:
            raise ValueError(f"LoRA weight must be a number, as in 'style.safetensors:0.8'; got {tail!r}") from None
        path = head
    if weight != weight or weight in (float("inf"), float("-inf")):
        raise ValueError(f"LoRA weight must be finite; got {weight!r}")
    resolved = Path(path).expanduser()
    if not resolved.is_absolute():
        resolved = Path(base_dir or Path.cwd()).resolve() / resolved
    if not resolved.exists():
        raise FileNotFoundError(f"LoRA {path} does not exist")
    return str(resolved), weight


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit] or "clip"


def parse_prompt_file(path: str | Path, base_seed: int = 0, defaults: dict[str, Any] | None = None,
                      loras: list[tuple[str, float]] | None = None) -> list[RenderJob]:
    """Read a prompt file into jobs; bad lines become jobs with ``error`` set instead of raising.

    Args:
        base_seed: seed of a line without one is ``base_seed + its job index``.
        defaults: call arguments that apply to every line unless the line sets them.
        loras: ``(path, weight)`` LoRAs of every line without a ``lora`` field (the CLI's ``--lora``). A line's
            ``lora`` is a ``"path[:weight]"`` string or a list of them (``[]``: none), paths relative to the prompt
            file; a missing file makes that line an error here, before anything renders.
    Raises:
        FileNotFoundError: the prompt file does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    jobs: list[RenderJob] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        job = RenderJob(line=number, seed=base_seed + len(jobs), call=dict(defaults or {}), loras=list(loras or []))
        jobs.append(job)
        try:
            # "[" too: a JSON array is a malformed line, not a prompt that happens to start with a bracket.
            entry = json.loads(text) if text.startswith(("{", "[")) else {"prompt": text}
            if not isinstance(entry, dict):
                raise ValueError("a JSON line must be an object")
            unknown = set(entry) - _LINE_KEYS
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)}; allowed: {sorted(_LINE_KEYS)}")
            if not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
                raise ValueError("missing or empty 'prompt'")
            job.prompt = entry["prompt"]
            if "seed" in entry:
                if isinstance(entry["seed"], bool) or not isinstance(entry["seed"], int):
                    raise ValueError(f"'seed' must be an integer; got {entry['seed']!r}")
                job.seed = entry["seed"]
            if entry.get("image") is not None:
                image = Path(str(entry["image"])).expanduser()
                # Absolute, so the job id does not depend on the working directory or how the file was named.
                job.image = str(image if image.is_absolute() else (path.resolve().parent / image))
            job.call.update({k: entry[k] for k in _CALL_KEYS if k in entry})
            if "lora" in entry:
                specs = [entry["lora"]] if isinstance(entry["lora"], str) else entry["lora"]
                if not isinstance(specs, list):
                    raise ValueError("'lora' must be a \"path[:weight]\" string or a list of them")
                job.loras = [parse_lora_spec(spec, path.resolve().parent) for spec in specs]
            job.name = _slug(str(entry.get("name") or job.prompt))
        except (ValueError, TypeError, FileNotFoundError) as exc:
            job.error = f"line {number}: {exc}"
    for index, job in enumerate(jobs):
        job.name = f"{index:04d}-{job.name or 'invalid'}-{job.job_id}"
    return jobs


def _remove_stale_temporaries(out_dir: Path, jobs: list[RenderJob]) -> None:
    """Delete what a killed run left half-written: hidden temporaries of the manifest and of this batch's clips.

    Writers create ``.<name>.<random>`` siblings and rename them into place (see ``video.export``); a run killed
    mid-write leaves one behind. Only names derived from this batch's jobs are touched.
    """
    import shutil

    prefixes = (TMP_MANIFEST_PREFIX, *(f".{job.name}." for job in jobs))
    for entry in out_dir.iterdir():
        if not entry.name.startswith(prefixes) and entry.name != LOCK_NAME:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


class Manifest:
    """One JSON record per job in ``out_dir/manifest.jsonl``, rewritten atomically after every change.

    ``shared=True`` when several processes write it: each :meth:`write` then holds an exclusive ``flock`` on
    ``out_dir/.render.lock`` and re-reads the file first, so records other processes wrote are kept.
    """

    def __init__(self, out_dir: Path, shared: bool = False):
        self.path = out_dir / MANIFEST
        self.shared = shared
        self.records: dict[str, dict[str, Any]] = {}
        self._load()

    def _load(self) -> None:
        self.records = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    self.records[record["job_id"]] = record

    @contextlib.contextmanager
    def _exclusive(self):
        if not self.shared:
            yield
            return
        import fcntl

        fd = os.open(self.path.parent / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._load()  # what the other processes wrote since this one last looked
            yield
        finally:
            os.close(fd)  # releases the lock

    def finished(self, job: RenderJob, out_dir: Path, suffix: str) -> bool:
        """True when the job's clip was recorded ok in the format asked now and is still on disk."""
        record = self.records.get(job.job_id)
        if not record or record.get("status") != "ok" or Path(record["path"]).suffix != suffix:
            return False
        clip = out_dir / record["path"]
        return clip.is_file() if suffix else clip.is_dir()

    def write(self, order: list[RenderJob], record: dict[str, Any] | None = None) -> None:
        """Store ``record`` (if given) and rewrite the file with the jobs of ``order`` first, in that order, each
        with its line number in the current prompt file (lines may have moved since a clip was rendered)."""
        with self._exclusive():
            if record is not None:
                self.records[record["job_id"]] = record
            for job in order:
                if job.job_id in self.records:
                    self.records[job.job_id]["line"] = job.line
            ids = [job.job_id for job in order]
            lines = [json.dumps(self.records[i]) for i in ids if i in self.records]
            current = set(ids)
            lines += [json.dumps(r) for i, r in self.records.items() if i not in current]  # earlier prompt files
            fd, tmp = tempfile.mkstemp(prefix=TMP_MANIFEST_PREFIX, dir=self.path.parent)
            os.fchmod(fd, umask_mode())  # mkstemp makes 0600; the manifest is as readable as any file the user writes
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)


def use_loras(pipe, specs: list[tuple[str, float]]) -> list:
    """Make ``specs`` the active LoRAs of ``pipe`` (no-op when none are asked and none were ever loaded, so any
    callable serves as a pipeline for LoRA-free batches)."""
    if not specs and not getattr(pipe, "list_loras", list)():
        return []
    return pipe.loras.use(specs)


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's part of a batch that several processes render together (one process: the defaults).

    Attributes:
        index / count: this process takes the unfinished jobs ``index, index + count, ...`` (prompt-file order).
        writes: False on a CFG-parallel partner or a context-parallel peer: it computes its part of the same jobs;
            CFG and CP rank 0 saves the clips and the records.
        sync: returns once every process of the batch has called it (a barrier). Called after the folder is
            cleaned, after every process has read the manifest (so all split the same unfinished jobs) and at
            the end.
    Raises:
        ValueError: ``count < 1`` or ``index`` outside ``[0, count)``.
    """

    index: int = 0
    count: int = 1
    writes: bool = True
    sync: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} of {self.count}: need count >= 1 and 0 <= index < count")

    @property
    def leader(self) -> bool:
        """The process that cleans the folder and counts the jobs finished earlier."""
        return self.index == 0 and self.writes

    @property
    def shared(self) -> bool:
        """True when other processes write the same folder."""
        return self.count > 1 or self.sync is not None

    def wait(self) -> None:
        if self.sync is not None:
            self.sync()


@contextlib.contextmanager
def _recorded_warnings(record: dict[str, Any], line: int | None):
    """Put the ``UserWarning`` messages raised inside into ``record["warnings"]`` (e.g. a negative prompt that
    had no effect) and on the terminal with the job's ``line`` (None: not printed); other warnings pass on."""
    from tqdm.auto import tqdm

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)  # every job's, not only the first of a batch
            yield
    finally:  # a failed call's warnings are recorded too
        for item in caught:  # after the block: they meet the caller's filters again
            if not issubclass(item.category, UserWarning):
                warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
        messages = list(dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, UserWarning)))
        if messages:
            record["warnings"] = messages
        for message in messages if line is not None else ():
            tqdm.write(f"line {line}: warning: {message}", file=sys.stderr)


@dataclass(slots=True)
class BatchSummary:
    """Counts of one batch run: rendered now, skipped (finished earlier), failed."""

    rendered: int = 0
    skipped: int = 0
    failed: int = 0
    manifest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def render_batch(
    jobs: list[RenderJob],
    out_dir: str | Path,
    get_pipeline: Callable[[str], Any],
    fmt: str = "mp4",
    fps: float | None = None,
    progress: bool = True,
    shard: Shard | None = None,
) -> BatchSummary:
    """Render every unfinished job; record each result in the manifest as soon as it is known.

    Args:
        get_pipeline: ``task -> pipeline`` ("text-to-video" or "image-to-video"), called lazily so a batch of
            text prompts never builds an image-to-video pipeline.
        fmt: "mp4", "gif" or "png" (a folder of frames per clip).
        shard: this process's part when several render the batch (records then carry ``"dp_rank"``); default
            all of it.
    Returns:
        this process's counts (``skipped`` counted by the leader only; zeros on a CFG partner).
    Raises:
        ValueError: an unknown format (before any work).
    """
    from tqdm.auto import tqdm

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}; got {fmt!r}")
    shard = Shard() if shard is None else shard
    out_dir = Path(out_dir)
    if shard.leader:
        out_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(out_dir, jobs)
    shard.wait()  # nobody reads the folder before it is clean
    manifest = Manifest(out_dir, shared=shard.shared)
    summary = BatchSummary(manifest=str(manifest.path))
    suffix = "" if fmt == "png" else f".{fmt}"
    pending = [job for job in jobs if not manifest.finished(job, out_dir, suffix)]
    shard.wait()  # every process has read the same manifest, so all split the same pending list
    if shard.leader:
        summary.skipped = len(jobs) - len(pending)
    for job in tqdm(pending[shard.index::shard.count], desc="render", unit="clip", disable=not progress):
        # A line that did not parse rendered nothing: its seed is no seed the user gave or a clip used (the error
        # quotes the bad value instead).
        record: dict[str, Any] = {"job_id": job.job_id, "line": job.line, "prompt": job.prompt,
                                  "seed": None if job.error else job.seed, "image": job.image, "settings": job.call,
                                  "path": job.name + suffix}
        if shard.shared:
            record["dp_rank"] = shard.index
        started = time.perf_counter()
        try:
            if job.error:
                raise ValueError(job.error)
            pipe = get_pipeline("text-to-video" if job.image is None else "image-to-video")
            if job.loras:
                record["loras"] = [{"path": p, "weight": w} for p, w in job.loras]
            reports = use_loras(pipe, job.loras)
            for entry, report in zip(record.get("loras", []), reports):
                entry.update(adapter=report.adapter_name, modules=len(report.modules), skipped=report.num_skipped)
            with _recorded_warnings(record, job.line if shard.writes else None):
                if job.image is None:
                    output = pipe(job.prompt, seed=job.seed, **job.call)
                else:
                    output = pipe(job.image, job.prompt, seed=job.seed, **job.call)
            if shard.writes:
                output.save(out_dir / record["path"], fps=fps)
            record.update(status="ok", settings=output.settings, stats=output.stats.to_dict())
            summary.rendered += 1
        except Exception as exc:  # noqa: BLE001 - one failing clip must not stop the batch; the error is recorded
            record.update(status="error", error=f"{type(exc).__name__}: {exc}", path=None)  # no clip was written
            summary.failed += 1
            if shard.writes:  # say why on the terminal too, not only in the manifest
                tqdm.write(f"line {job.line} failed: {record['error']}", file=sys.stderr)
        record["seconds"] = round(time.perf_counter() - started, 3)
        if shard.writes:
            manifest.write(jobs, record)
    if summary.skipped:
        manifest.write(jobs)  # skipped jobs may have moved in the prompt file: keep the manifest in its order
    shard.wait()  # the batch is done when every process is
    if shard.leader and shard.shared:
        (out_dir / LOCK_NAME).unlink(missing_ok=True)
    if not shard.writes:
        summary.rendered = summary.failed = 0  # the peer that saved the clips counts them
    return summary
