"""The PostgreSQL backend of the job store (``psycopg`` 3 and its pool): one queue for a fleet of machines.

- Claims select the oldest queued row with ``FOR UPDATE SKIP LOCKED``: concurrent workers on any machine take
  different jobs without waiting on each other.
- Every write that makes work (a new job, a requeue) sends ``NOTIFY metainfer_video_jobs`` in its transaction;
  idle workers ``LISTEN`` on a connection of their own and wake at once (no polling for new jobs; an idle worker
  still wakes every ``timeout_s`` of :meth:`wait_for_work` to requeue expired leases).
- A lost connection (the server restarted, a network cut) is retried with back-off for ``retry_s`` seconds on a
  fresh connection (the pool drops broken ones), so a restarted server is picked up without a restart here.
  Statements are written so that a retry after a commit whose answer was lost changes nothing twice.
"""

from __future__ import annotations

import logging
import threading
import time

from metainfer_gen.serve.video.jobs import (DEFAULT_LEASE_S, DEFAULT_MAX_ATTEMPTS, SCHEMA_VERSION,
                                            JobStore, JobStoreUnavailable, check_schema_version)

CHANNEL = "metainfer_video_jobs"
DEFAULT_RETRY_S = 60.0
_CONNECT = {"connect_timeout": 5, "application_name": "metainfer-gen", "keepalives": 1, "keepalives_idle": 5,
            "keepalives_interval": 2, "keepalives_count": 3}
_MIGRATION_LOCK = 733_101  # pg_advisory_xact_lock key: machines starting together create the tables once
_TABLES = (
    "CREATE TABLE IF NOT EXISTS schema_info (version INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, seq BIGSERIAL NOT NULL, created_at BIGINT NOT NULL, "
    "status TEXT NOT NULL, request TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0, error TEXT, "
    "cancel_requested INTEGER NOT NULL DEFAULT 0, attempt INTEGER NOT NULL DEFAULT 0, "
    "renders INTEGER NOT NULL DEFAULT 0, worker INTEGER, render_seconds DOUBLE PRECISION, completed_at BIGINT, "
    "owner TEXT, lease_expires_at DOUBLE PRECISION, queued_at DOUBLE PRECISION, claimed_at DOUBLE PRECISION)",
    "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
)
log = logging.getLogger(__name__)


def describe(url: str) -> str:
    """``url`` without its password, for messages."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - a malformed address is reported by the connect that follows
        return "postgresql://(unparsable address)"
    return f"postgresql://{parts.get('user', '')}@{parts.get('host', '')}:{parts.get('port', 5432)}/" \
           f"{parts.get('dbname', '')}"


class PostgresJobStore(JobStore):
    """The fleet's job store in one PostgreSQL database (tables created on first use).

    Args:
        url: a libpq address, ``postgresql://user[:password]@host[:port]/dbname``.
        lease_s / max_attempts: see :class:`~.jobs.JobStore`.
        retry_s: how long an operation retries a lost connection before raising :class:`~.jobs.JobStoreUnavailable`.
        connect_timeout_s: how long opening waits for the first connection.
    Raises:
        JobStoreUnavailable: no connection within ``connect_timeout_s``.
        SchemaTooNew: the database holds a schema newer than this code's.
    """

    NOW = "EXTRACT(EPOCH FROM clock_timestamp())::float8"
    CLAIM_LOCK = " FOR UPDATE SKIP LOCKED"
    NEXT_SEQ = "DEFAULT"
    shared = True

    def __init__(self, url: str, lease_s: float = DEFAULT_LEASE_S, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                 retry_s: float = DEFAULT_RETRY_S, connect_timeout_s: float = 10.0):
        from psycopg_pool import ConnectionPool, PoolTimeout

        super().__init__(lease_s, max_attempts)
        self.url, self.retry_s = url, float(retry_s)
        self._listener = None
        self._listen_lock = threading.Lock()
        # No check-out probe (ConnectionPool.check_connection): it doubles the round trips of every statement, and
        # a connection that broke meanwhile fails its statement, is dropped by the pool, and the retry gets another.
        self._pool = ConnectionPool(url, min_size=1, max_size=4, kwargs=_CONNECT, open=False, timeout=5.0,
                                    name="metainfer-gen-jobs")
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except PoolTimeout:
            self._pool.close()
            raise JobStoreUnavailable(f"cannot connect to the job store {describe(url)} within {connect_timeout_s} "
                                      "s: is PostgreSQL running and reachable, and do the address, user and "
                                      "database exist?") from None
        self._migrate()

    def _migrate(self) -> None:
        def run(conn):
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            for statement in _TABLES:
                conn.execute(statement)
            found = conn.execute("SELECT MAX(version) FROM schema_info").fetchone()[0]
            if found is None:
                conn.execute("INSERT INTO schema_info (version) VALUES (%s)", (SCHEMA_VERSION,))
            else:
                check_schema_version(found, describe(self.url))
            return []

        self._run(run)

    def _run(self, work):
        """``work(connection)`` in one transaction, retried while the server cannot be reached."""
        import psycopg
        from psycopg_pool import PoolTimeout

        deadline, delay = time.monotonic() + self.retry_s, 0.05
        while True:
            try:
                with self._pool.connection() as conn:  # commits on success, rolls back on an error
                    return work(conn)
            except (psycopg.OperationalError, PoolTimeout) as exc:
                if time.monotonic() + delay > deadline:
                    raise JobStoreUnavailable(f"lost the job store {describe(self.url)} for {self.retry_s:g} s: "
                                              f"{type(exc).__name__}") from exc
                log.warning("job store %s unreachable (%s); retrying", describe(self.url), type(exc).__name__)
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    def _write(self, sql: str, args: tuple = (), notify: bool = False) -> list[tuple]:
        def run(conn):
            cursor = conn.execute(sql.replace("?", "%s"), args)
            rows = cursor.fetchall() if cursor.description else []
            if notify and rows:
                conn.execute("SELECT pg_notify(%s, '')", (CHANNEL,))
            return rows

        return self._run(run)

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self._write(sql, args)

    def listen(self) -> None:
        """Start receiving wake-ups on a connection of this store's own (idempotent; reconnects when lost)."""
        import psycopg

        with self._listen_lock:
            if self._listener is not None and not self._listener.closed:
                return
            self._listener = psycopg.connect(self.url, autocommit=True, **_CONNECT)
            self._listener.execute(f"LISTEN {CHANNEL}")

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until a ``NOTIFY`` (a job was queued or requeued) or ``timeout_s`` seconds passed."""
        import psycopg

        try:
            self.listen()
            for _ in self._listener.notifies(timeout=timeout_s, stop_after=1):
                pass
        except psycopg.OperationalError:  # the server went away: the next call reconnects
            with self._listen_lock:
                if self._listener is not None:
                    self._listener.close()
                self._listener = None
            time.sleep(min(timeout_s, 0.5))

    def close(self) -> None:
        with self._listen_lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        self._pool.close()
