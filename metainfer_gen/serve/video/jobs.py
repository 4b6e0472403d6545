"""The video job store: one SQLite file (standard library ``sqlite3``, WAL mode) that the server and every worker
process open, and that outlives any of them.

A job moves ``queued -> in_progress -> completed | failed | cancelled``. Workers take jobs with :meth:`claim`, an
``UPDATE ... RETURNING`` inside ``BEGIN IMMEDIATE`` (SQLite's write lock), so two workers never take the same job.
Every claim gets a fresh ``attempt`` number, and a worker may record the end of a job only while the row still
holds its attempt: after a crash, :meth:`requeue_interrupted` puts running jobs back in the queue, and a worker of
the dead server that somehow lived on can no longer complete them. ``renders`` counts completions, so "each job
exactly once" is a number in the store, not a belief.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

STORE_NAME = "jobs.sqlite3"
_BUSY_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    request TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    attempt INTEGER NOT NULL DEFAULT 0,
    renders INTEGER NOT NULL DEFAULT 0,
    worker INTEGER,
    render_seconds REAL,
    completed_at INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class JobStatus(str, Enum):
    """OpenAI's video statuses (``cancelled`` is vLLM-Omni's addition)."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


@dataclass(frozen=True, slots=True)
class Job:
    """One row. ``request`` is the checked request as a dict (:class:`~.request.VideoRequest` fields);
    ``progress`` is in percent; ``created_at`` / ``completed_at`` are Unix seconds."""

    id: str
    created_at: int
    status: JobStatus
    request: dict[str, Any]
    progress: int = 0
    error: str | None = None
    cancel_requested: bool = False
    attempt: int = 0
    renders: int = 0
    worker: int | None = None
    render_seconds: float | None = None
    completed_at: int | None = None


_COLUMNS = "id, created_at, status, request, progress, error, cancel_requested, attempt, renders, worker, " \
           "render_seconds, completed_at"


def _job(row: tuple) -> Job:
    return Job(row[0], row[1], JobStatus(row[2]), json.loads(row[3]), row[4], row[5], bool(row[6]), *row[7:])


class JobStore:
    """The jobs of one data folder. Open one per process (a connection is not shared across processes).

    Args:
        path: the SQLite file (created with its tables when missing; its folder must exist).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.RLock()  # one connection serves the server's threads: one transaction at a time
        self._db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL under WAL: a commit survives any process crash (kill -9); only a power cut may lose the last few.
        # FULL would fsync on every progress update of every denoising step.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple = ()) -> list[tuple]:
        """One statement in its own immediate transaction (takes the write lock first: no upgrade deadlock)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute(sql, args).fetchall()
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return rows

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- the server's side ------------------------------------------------------------------------------------
    def add(self, job_id: str, request: dict[str, Any]) -> Job:
        """Queue a new job (``job_id``: a random UUID the caller made). Returns its row."""
        now = int(time.time())
        self._write("INSERT INTO jobs (id, seq, created_at, status, request) VALUES "
                    "(?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs), ?, ?, ?)",
                    (job_id, now, JobStatus.QUEUED.value, json.dumps(request)))
        return self.get(job_id)

    def get(self, job_id: str) -> Job | None:
        rows = self._read(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,))
        return _job(rows[0]) if rows else None

    def list(self, limit: int = 20, after: str | None = None) -> list[Job]:
        """Newest first; ``after``: only jobs older than that id (OpenAI's cursor). Raises KeyError for an
        unknown ``after``."""
        if after is None:
            rows = self._read(f"SELECT {_COLUMNS} FROM jobs ORDER BY seq DESC LIMIT ?", (limit,))
        else:
            cursor = self._read("SELECT seq FROM jobs WHERE id = ?", (after,))
            if not cursor:
                raise KeyError(after)
            rows = self._read(f"SELECT {_COLUMNS} FROM jobs WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                              (cursor[0][0], limit))
        return [_job(r) for r in rows]

    def cancel(self, job_id: str) -> Job | None:
        """A queued job becomes ``cancelled`` at once; a running one is flagged (its worker stops at the next
        denoising step). Returns the row after the change (None: no such job)."""
        self._write("UPDATE jobs SET status = CASE status WHEN 'queued' THEN 'cancelled' ELSE status END, "
                    "cancel_requested = CASE status WHEN 'in_progress' THEN 1 ELSE cancel_requested END "
                    "WHERE id = ?", (job_id,))
        return self.get(job_id)

    def delete(self, job_id: str) -> bool:
        """Remove a finished job's row (its clip is the caller's to remove). False when it is not finished."""
        rows = self._write("DELETE FROM jobs WHERE id = ? AND status IN ('completed', 'failed', 'cancelled') "
                           "RETURNING id", (job_id,))
        return bool(rows)

    def requeue_interrupted(self) -> int:
        """Put every ``in_progress`` job back in the queue (call at start-up, before any worker runs): those of a
        server that was killed. A cancel asked of one makes it ``cancelled`` instead. Returns how many moved."""
        rows = self._write("UPDATE jobs SET status = CASE cancel_requested WHEN 1 THEN 'cancelled' ELSE 'queued' "
                           "END, progress = 0, worker = NULL WHERE status = 'in_progress' RETURNING id")
        return len(rows)

    def counts(self) -> dict[JobStatus, int]:
        found = dict(self._read("SELECT status, COUNT(*) FROM jobs GROUP BY status"))
        return {status: found.get(status.value, 0) for status in JobStatus}

    def render_seconds(self) -> list[float]:
        """Render times of the completed jobs, in seconds (the clip-seconds histogram)."""
        rows = self._read("SELECT render_seconds FROM jobs WHERE status = 'completed' AND render_seconds IS NOT NULL")
        return [r[0] for r in rows]

    def set_meta(self, key: str, value: Any) -> None:
        self._write("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def delete_meta(self, key: str) -> None:
        """Forget one reported value (a worker's ``ready:{index}`` when it died)."""
        self._write("DELETE FROM meta WHERE key = ?", (key,))

    def clear_meta(self) -> None:
        """Forget what workers reported (at start-up: the model may have changed since)."""
        self._write("DELETE FROM meta")

    def get_meta(self, key: str) -> Any:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else None

    # -- the workers' side ------------------------------------------------------------------------------------
    def claim(self, worker: int) -> Job | None:
        """Take the oldest queued job (atomically: no two workers get the same one), or None."""
        rows = self._write(f"UPDATE jobs SET status = 'in_progress', attempt = attempt + 1, worker = ?, progress = 0 "
                           f"WHERE id = (SELECT id FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT 1) "
                           f"RETURNING {_COLUMNS}", (worker,))
        return _job(rows[0]) if rows else None

    def _end(self, job: Job, sets: str, args: tuple, extra: str = "") -> bool:
        rows = self._write(f"UPDATE jobs SET {sets} WHERE id = ? AND status = 'in_progress' AND attempt = ? {extra}"
                           f"RETURNING id", (*args, job.id, job.attempt))
        return bool(rows)

    def set_progress(self, job: Job, percent: int) -> bool:
        """Record progress; returns False when the job should stop (cancel asked, or no longer this attempt's)."""
        rows = self._write("UPDATE jobs SET progress = ? WHERE id = ? AND status = 'in_progress' AND attempt = ? "
                           "RETURNING cancel_requested", (int(percent), job.id, job.attempt))
        return bool(rows) and not rows[0][0]

    def complete(self, job: Job, seconds: float) -> bool:
        """Mark the job completed (its clip is already in place) and count the render. False: a cancel came
        after the last step (see :meth:`mark_cancelled`), or the job is not this attempt's any more."""
        return self._end(job, "status = 'completed', progress = 100, renders = renders + 1, render_seconds = ?, "
                              "completed_at = ?", (seconds, int(time.time())), "AND cancel_requested = 0 ")

    def fail(self, job: Job, error: str) -> bool:
        return self._end(job, "status = 'failed', error = ?, completed_at = ?", (error, int(time.time())))

    def fail_running_of(self, worker: int, error: str) -> int:
        """Fail the job ``worker`` was running (the worker process died under it); returns how many."""
        rows = self._write("UPDATE jobs SET status = 'failed', error = ?, completed_at = ? WHERE status = "
                           "'in_progress' AND worker = ? RETURNING id", (error, int(time.time()), worker))
        return len(rows)

    def mark_cancelled(self, job: Job) -> bool:
        return self._end(job, "status = 'cancelled', completed_at = ?", (int(time.time()),))
