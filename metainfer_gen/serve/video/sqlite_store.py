"""The SQLite backend of the job store (standard library ``sqlite3``, WAL mode): one file in ``--data-dir`` that the
server and its worker processes open on one machine, and that outlives any of them.

Claims run inside ``BEGIN IMMEDIATE`` (SQLite's write lock), so two workers never take the same job. Idle workers
poll every :data:`POLL_S` seconds (one indexed SELECT): SQLite has no notifications across processes.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from metainfer_gen.serve.video.jobs import (DEFAULT_LEASE_S, DEFAULT_MAX_ATTEMPTS, SCHEMA_VERSION, JobStore,
                                            JobStoreCorrupt, check_schema_version)

STORE_NAME = "jobs.sqlite3"
POLL_S = 0.05  # an idle worker looks for a job this often
BUSY_TIMEOUT_S = 30.0  # how long a statement waits for another process's write lock before it fails

_TABLES = """
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
    completed_at INTEGER,
    owner TEXT,
    lease_expires_at REAL,
    queued_at REAL,
    claimed_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_V1_TO_V2 = tuple(f"ALTER TABLE jobs ADD COLUMN {column}" for column in (
    "owner TEXT", "lease_expires_at REAL", "queued_at REAL", "claimed_at REAL"))


class SQLiteJobStore(JobStore):
    """The jobs of one data folder. Open one per process (a connection is not shared across processes).

    Args:
        path: the SQLite file (created with its tables when missing; its folder must exist). A file made before
            leases existed (schema 1) is upgraded in place.
        lease_s / max_attempts: see :class:`~.jobs.JobStore`.
        busy_timeout_s: how long a statement waits for another process's write lock, seconds; then it raises
            ``sqlite3.OperationalError`` (database is locked), which the routes answer with a 503.
    Raises:
        SchemaTooNew: the file was made by a newer metainfer-gen. JobStoreCorrupt: the file is not a readable
            SQLite database (the message names it and the way out).
    """

    NOW = "((julianday('now') - 2440587.5) * 86400.0)"
    NEXT_SEQ = "(SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs)"

    def __init__(self, path: str | Path, lease_s: float = DEFAULT_LEASE_S,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS, busy_timeout_s: float = BUSY_TIMEOUT_S):
        super().__init__(lease_s, max_attempts)
        self.path = Path(path)
        self._lock = threading.RLock()  # one connection serves the server's threads: one transaction at a time
        self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL under WAL: a commit survives any process crash (kill -9); only a power cut may lose the last
            # few. FULL would fsync on every progress update of every denoising step.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            if isinstance(exc, sqlite3.OperationalError):  # locked, or a folder we may not write: not corruption
                raise
            raise JobStoreCorrupt(
                f"the job store {self.path} cannot be read ({exc}): stop every server and worker using it, then "
                f"move it aside (mv {self.path} {self.path}.corrupt) to start with an empty queue (finished clips "
                "stay in the clips folder), or put back a backup of it") from None

    def _migrate(self) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                version = self._db.execute("PRAGMA user_version").fetchone()[0]
                check_schema_version(version, str(self.path))
                old = self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'jobs'").fetchone()
                if old and version < 2:  # a schema-1 file: user_version was never set then
                    for statement in _V1_TO_V2:
                        self._db.execute(statement)
                for statement in filter(str.strip, _TABLES.split(";")):
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple = (), notify: bool = False) -> list[tuple]:
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

    def wait_for_work(self, timeout_s: float) -> None:
        """Sleep :data:`POLL_S` (at most ``timeout_s``) seconds: the next claim looks again."""
        time.sleep(max(0.0, min(POLL_S, timeout_s)))
