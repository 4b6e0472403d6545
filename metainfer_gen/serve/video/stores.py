"""Open a job store from what the user typed: a ``postgresql://`` address (the fleet's), a ``sqlite:///path`` one,
or a plain path to a SQLite file (one machine)."""

from __future__ import annotations

from pathlib import Path

from metainfer_gen.serve.video.jobs import DEFAULT_LEASE_S, DEFAULT_MAX_ATTEMPTS, JobStore

_SCHEMES = ("postgresql", "postgres", "sqlite")


def store_scheme(spec: str | Path) -> str:
    """``"postgresql"`` or ``"sqlite"`` for a store address (a path without a scheme is a SQLite file).

    Raises:
        ValueError: a scheme other than postgresql://, postgres:// or sqlite://.
    """
    text = str(spec)
    scheme, sep, _ = text.partition("://")
    if not sep:
        return "sqlite"
    if scheme not in _SCHEMES:
        raise ValueError(f"unknown job store {text!r}: give postgresql://user@host:port/dbname, sqlite:///path, or "
                         "a path to a SQLite file")
    return "sqlite" if scheme == "sqlite" else "postgresql"


def open_job_store(spec: str | Path, lease_s: float = DEFAULT_LEASE_S,
                   max_attempts: int = DEFAULT_MAX_ATTEMPTS, busy_timeout_s: float | None = None) -> JobStore:
    """The store at ``spec`` (see :func:`store_scheme`); SQLite files are created when missing.
    ``busy_timeout_s``: how long a SQLite statement waits for another process's write lock (None: the backend's
    default, 30 s; PostgreSQL waits for its row locks).

    Raises:
        ValueError: an unknown scheme. JobStoreUnavailable: PostgreSQL unreachable. SchemaTooNew: see the backends.
        ImportError: a PostgreSQL address without psycopg (``pip install 'metainfer-gen[fleet]'``).
    """
    if store_scheme(spec) == "postgresql":
        try:
            import psycopg  # noqa: F401
            import psycopg_pool  # noqa: F401
        except ImportError as exc:
            raise ImportError("a postgresql:// job store needs psycopg: pip install 'metainfer-gen[fleet]'") from exc
        from metainfer_gen.serve.video.postgres_store import PostgresJobStore

        return PostgresJobStore(str(spec), lease_s, max_attempts)
    from metainfer_gen.serve.video.sqlite_store import SQLiteJobStore

    text = str(spec)
    options = {} if busy_timeout_s is None else {"busy_timeout_s": busy_timeout_s}
    return SQLiteJobStore(text.removeprefix("sqlite://") if text.startswith("sqlite://") else text, lease_s,
                          max_attempts, **options)
