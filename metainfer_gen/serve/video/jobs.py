"""The video job store: one interface (:class:`JobStore`), two backends (``sqlite_store``: one machine, nothing to
set up; ``postgres_store``: a fleet of machines sharing one queue). The SQL is written once here; a backend supplies
its connection, its clock expression, its claim lock clause and its wake-ups.

A job moves ``queued -> in_progress -> completed | failed | cancelled``. A worker takes a job with :meth:`claim`
(atomically: no two workers get the same one) and holds it under a *lease* that its heartbeat renews
(:meth:`renew`); every claim bumps ``attempt``, the fencing token: a worker may record progress or the end of a job
only while the row still holds its attempt, so a worker whose lease ran out and was taken over can neither finish
nor write the job. Expired leases go back to the queue (:meth:`requeue_expired`) until ``max_attempts`` claims have
been spent, then the job fails. ``renders`` counts completions, so "each job exactly once" is a number in the
store, not a belief. Times are the database's clock (one clock for the whole fleet).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

SCHEMA_VERSION = 2  # 1: before leases; 2: leases (owner, lease_expires_at, queued_at, claimed_at)
DEFAULT_LEASE_S = 30.0
DEFAULT_MAX_ATTEMPTS = 3
log = logging.getLogger(__name__)


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
    ``progress`` is in percent; ``created_at`` / ``completed_at`` are Unix seconds; ``owner`` names the worker
    holding (or last holding) the job, ``"<node>/<index>"``; ``lease_expires_at``, ``queued_at`` (the last time it
    entered the queue) and ``claimed_at`` (its last claim) are Unix seconds on the database's clock."""

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
    owner: str | None = None
    lease_expires_at: float | None = None
    queued_at: float | None = None
    claimed_at: float | None = None


class SchemaTooNew(RuntimeError):
    """The store was made by a newer metainfer-gen than this one: refuse it rather than misread it."""


class JobStoreCorrupt(RuntimeError):
    """The store's file is not a database this code can read (truncated, overwritten, not SQLite at all)."""


class JobStoreUnavailable(RuntimeError):
    """The store cannot be reached (the database server is down or the address is wrong) within the retry time."""


def check_schema_version(found: int, where: str) -> None:
    """Raise :class:`SchemaTooNew` when ``found`` is newer than :data:`SCHEMA_VERSION`."""
    if found > SCHEMA_VERSION:
        raise SchemaTooNew(f"the job store {where} has schema version {found}, newer than the {SCHEMA_VERSION} this "
                           "metainfer-gen knows: upgrade metainfer-gen on this machine (every machine of a fleet "
                           "must run a version that knows the store's schema)")


_COLUMNS = ("id, created_at, status, request, progress, error, cancel_requested, attempt, renders, worker, "
            "render_seconds, completed_at, owner, lease_expires_at, queued_at, claimed_at")


_HELD = "id = ? AND status = 'in_progress' AND attempt = ?"  # the row still holds this claim (the fence)


def _job(row) -> Job:
    """The row as a :class:`Job`; a row this code cannot read (its request not a JSON object, an unknown status:
    hand edits, a newer version's values) reads as ``failed`` with the reason, so it never breaks a list, and
    ``DELETE`` removes it."""
    try:
        status, request = JobStatus(row[2]), json.loads(row[3])
        if not isinstance(request, dict):
            raise ValueError(f"the request is a JSON {type(request).__name__}, not an object")
    except (TypeError, ValueError) as exc:  # json's JSONDecodeError is a ValueError
        log.warning("job %s: the stored row cannot be read: %s", row[0], exc)
        return Job(row[0], row[1], JobStatus.FAILED, {}, row[4], f"the stored job cannot be read ({exc}); delete "
                                                                  "it", bool(row[6]), *row[7:])
    return Job(row[0], row[1], status, request, row[4], row[5], bool(row[6]), *row[7:])


class JobStore:
    """The interface both backends implement; every method is one short transaction.

    A backend sets ``NOW`` (SQL for the database's clock, Unix seconds), ``CLAIM_LOCK`` (appended to the claim's
    row selection: PostgreSQL's ``FOR UPDATE SKIP LOCKED``), ``NEXT_SEQ`` (the insert's ordering value) and
    ``shared`` (True when many machines may use the store: no start-up may then requeue others' running jobs), and
    implements :meth:`_write`, :meth:`_read`, :meth:`wait_for_work` and :meth:`close` (and :meth:`listen` where it
    has wake-ups). :func:`~.stores.open_job_store` opens one from an address.

    Args (of every backend): lease_s: how long a claim holds without a heartbeat, seconds; max_attempts: claims a
        job may take before an expired lease fails it instead of requeueing it.
    """

    NOW = ""
    CLAIM_LOCK = ""
    NEXT_SEQ = ""
    shared = False

    def __init__(self, lease_s: float = DEFAULT_LEASE_S, max_attempts: int = DEFAULT_MAX_ATTEMPTS):
        if not lease_s > 0 or max_attempts < 1:
            raise ValueError(f"lease_s must be > 0 and max_attempts >= 1; got {lease_s}, {max_attempts}")
        self.lease_s = float(lease_s)
        self.max_attempts = int(max_attempts)

    # -- what a backend provides ------------------------------------------------------------------------------
    def _write(self, sql: str, args: tuple = (), notify: bool = False) -> list[tuple]:
        """Run one statement in its own write transaction; ``notify``: wake idle workers when it commits."""
        raise NotImplementedError

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        raise NotImplementedError

    def listen(self) -> None:
        """Start receiving wake-ups (a worker calls it before its first claim); a no-op where there are none."""

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until a job may be waiting (a wake-up) or ``timeout_s`` seconds passed."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # -- the server's side ------------------------------------------------------------------------------------
    def add(self, job_id: str, request: dict[str, Any]) -> Job:
        """Queue a new job (``job_id``: a random UUID the caller made; adding it again changes nothing)."""
        self._write(f"INSERT INTO jobs (id, seq, created_at, status, request, queued_at) VALUES (?, {self.NEXT_SEQ}, "
                    f"?, ?, ?, {self.NOW}) "
                    "ON CONFLICT (id) DO NOTHING RETURNING id",
                    (job_id, int(time.time()), JobStatus.QUEUED.value, json.dumps(request)), notify=True)
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
        """A queued job becomes ``cancelled`` at once; a running one is flagged (its worker, on whichever machine,
        stops at the next denoising step). Returns the row after the change (None: no such job)."""
        self._write("UPDATE jobs SET status = CASE status WHEN 'queued' THEN 'cancelled' ELSE status END, "
                    "cancel_requested = CASE status WHEN 'in_progress' THEN 1 ELSE cancel_requested END "
                    "WHERE id = ?", (job_id,))
        return self.get(job_id)

    def delete(self, job_id: str) -> bool:
        """Remove a finished job's row, or one whose status this code cannot read (its clip is the caller's to
        remove). False when it is queued or running."""
        rows = self._write("DELETE FROM jobs WHERE id = ? AND status NOT IN ('queued', 'in_progress') "
                           "RETURNING id", (job_id,))
        return bool(rows)

    def requeue_interrupted(self) -> int:
        """Put every ``in_progress`` job back in the queue, leases or not: only for a store one server owns (at its
        start, before its workers run). A cancel asked of one makes it ``cancelled``, and one that has had
        ``max_attempts`` claims ``failed`` (a job that takes its server down never loops across restarts). Returns
        how many moved."""
        if self.shared:
            raise RuntimeError("requeue_interrupted would take running jobs from other machines of the fleet; a "
                               "shared store requeues expired leases only (requeue_expired)")
        return self._requeue("TRUE", (), "its server stopped while it ran, each time")

    def requeue_expired(self) -> int:
        """Requeue the running jobs whose lease ran out (their worker's machine died or lost the store); a job that
        has had ``max_attempts`` claims fails instead, a cancelled one ends cancelled. Returns how many moved."""
        return self._requeue(f"lease_expires_at < {self.NOW}", (), "the worker's lease expired each time")

    def requeue_running_of(self, owner: str, why: str) -> int:
        """Requeue the job the worker ``owner`` was running (its process died under it: ``why``), or fail it once it
        has had ``max_attempts`` claims (a job that kills its worker is not retried forever); returns how many."""
        return self._requeue("owner = ?", (owner,), why)

    def _requeue(self, where: str, args: tuple, why: str) -> int:
        rows = self._write(f"UPDATE jobs SET status = CASE WHEN cancel_requested = 1 THEN 'cancelled' "
                           f"WHEN attempt >= ? THEN 'failed' ELSE 'queued' END, "
                           f"error = CASE WHEN cancel_requested = 0 AND attempt >= ? THEN ? ELSE error END, "
                           f"completed_at = CASE WHEN cancel_requested = 1 OR attempt >= ? THEN ? ELSE NULL END, "
                           f"progress = 0, lease_expires_at = NULL, queued_at = {self.NOW} "
                           f"WHERE status = 'in_progress' AND {where} RETURNING id",
                           (self.max_attempts, self.max_attempts, f"gave up after {self.max_attempts} attempts: {why}",
                            self.max_attempts, int(time.time()), *args), notify=True)
        return len(rows)

    def counts(self) -> dict[JobStatus, int]:
        found = dict(self._read("SELECT status, COUNT(*) FROM jobs GROUP BY status"))
        return {status: found.get(status.value, 0) for status in JobStatus}

    def render_seconds(self) -> list[float]:
        """Render times of the completed jobs, in seconds (the clip-seconds histogram)."""
        rows = self._read("SELECT render_seconds FROM jobs WHERE status = 'completed' AND render_seconds IS NOT NULL")
        return [r[0] for r in rows]

    def set_meta(self, key: str, value: Any) -> None:
        self._write("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = "
                    "excluded.value", (key, json.dumps(value)))

    def delete_meta(self, key: str) -> None:
        """Forget one reported value (a worker's ``ready:...`` when it died)."""
        self._write("DELETE FROM meta WHERE key = ?", (key,))

    def clear_meta(self) -> None:
        """Forget what workers reported (at a single server's start: the model may have changed since)."""
        self._write("DELETE FROM meta")

    def get_meta(self, key: str) -> Any:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else None

    # -- the workers' side ------------------------------------------------------------------------------------
    def claim(self, worker: int, owner: str | None = None) -> Job | None:
        """Requeue expired leases, then take the oldest queued job under a fresh lease (atomically: no two workers
        get the same one), or None. ``owner``: the claiming worker's name (default ``"local/<worker>"``)."""
        self.requeue_expired()
        rows = self._write(f"UPDATE jobs SET status = 'in_progress', attempt = attempt + 1, worker = ?, owner = ?, "
                           f"progress = 0, lease_expires_at = {self.NOW} + ?, claimed_at = {self.NOW} "
                           f"WHERE id = (SELECT id FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT 1"
                           f"{self.CLAIM_LOCK}) AND status = 'queued' RETURNING {_COLUMNS}",
                           (worker, owner or f"local/{worker}", self.lease_s))
        return _job(rows[0]) if rows else None

    def renew(self, job: Job) -> bool:
        """The heartbeat: extend ``job``'s lease by ``lease_s``. False: the job is no longer this attempt's."""
        rows = self._write(f"UPDATE jobs SET lease_expires_at = {self.NOW} + ? WHERE {_HELD} "
                           f"RETURNING id", (self.lease_s, job.id, job.attempt))
        return bool(rows)

    def set_progress(self, job: Job, percent: int) -> bool:
        """Record progress (and renew the lease); False when the job should stop (cancel asked, or no longer this
        attempt's)."""
        rows = self._write(f"UPDATE jobs SET progress = ?, lease_expires_at = {self.NOW} + ? "
                           f"WHERE {_HELD} RETURNING cancel_requested",
                           (int(percent), self.lease_s, job.id, job.attempt))
        return bool(rows) and not rows[0][0]

    def _end(self, job: Job, status: JobStatus, sets: str, args: tuple, extra: str = "") -> bool:
        rows = self._write(f"UPDATE jobs SET status = '{status.value}', lease_expires_at = NULL, {sets} "
                           f"WHERE {_HELD} {extra}RETURNING id", (*args, job.id, job.attempt))
        if rows:
            return True
        now = self.get(job.id)  # a retried commit whose first answer was lost already did it
        return now is not None and now.status is status and now.attempt == job.attempt and now.owner == job.owner

    def complete(self, job: Job, seconds: float) -> bool:
        """Mark the job completed (its clip is already in place) and count the render. False: a cancel came
        after the last step (see :meth:`mark_cancelled`), or the job is not this attempt's any more."""
        return self._end(job, JobStatus.COMPLETED, "progress = 100, renders = renders + 1, render_seconds = ?, "
                                                   "completed_at = ?", (seconds, int(time.time())),
                         "AND cancel_requested = 0 ")

    def fail(self, job: Job, error: str) -> bool:
        return self._end(job, JobStatus.FAILED, "error = ?, completed_at = ?", (error, int(time.time())))

    def mark_cancelled(self, job: Job) -> bool:
        return self._end(job, JobStatus.CANCELLED, "completed_at = ?", (int(time.time()),))
