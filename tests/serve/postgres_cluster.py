"""A throw-away PostgreSQL server for the tests: ``initdb`` into a temporary folder and ``pg_ctl`` on a free port,
run as the ``postgres`` user when the tests run as root (PostgreSQL refuses root), trust authentication, stopped
(``pg_ctl stop -m immediate``) when the tests end.

Under ``CI=true`` a server that cannot be started is a failure; elsewhere the tests that need one skip when the
PostgreSQL binaries are missing. ``METAINFER_GEN_TEST_PG`` (a ``postgresql://`` address, e.g. the one ``.ci/run``
started) is used instead of starting one.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

ENV_URL = "METAINFER_GEN_TEST_PG"


def postgres_bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl`` (Debian's ``/usr/lib/postgresql/N/bin``, else PATH), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresCluster:
    """One server in a fresh folder under /tmp (the postgres user must reach it: pytest's own temporary folders are
    root's alone), listening on ``listen`` (comma-separated addresses); :meth:`remove` deletes it.

    Args:
        listen: ``listen_addresses`` (default loopback only).
        port: TCP port (default: a free one).
    Raises:
        RuntimeError (from :meth:`start`): no PostgreSQL binaries, or initdb / pg_ctl failed (with their output).
    """

    def __init__(self, listen: str = "127.0.0.1", port: int | None = None):
        self.folder = Path(tempfile.mkdtemp(prefix="metainfer-gen-pg-"))
        self.listen, self.port = listen, port or free_port()
        self.data = self.folder / "data"
        self.bindir = postgres_bindir()

    def _as_postgres(self, *command: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done

    def start(self) -> "PostgresCluster":
        """initdb (first time) and start; returns self once the server accepts connections."""
        if self.bindir is None:
            raise RuntimeError("no PostgreSQL binaries (apt-get install postgresql)")
        if not self.data.exists():
            if os.geteuid() == 0:
                shutil.chown(self.folder, "postgres", "postgres")
            self._as_postgres(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                              "--no-sync", timeout_s=120)
            if self.listen != "127.0.0.1":  # other hosts (network namespaces) on the server's own subnets
                with open(self.data / "pg_hba.conf", "a") as hba:
                    hba.write("host all all samenet trust\n")
        self._as_postgres(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-l",
                          str(self.folder / "server.log"), "-o",
                          f"-p {self.port} -k {self.folder} -c listen_addresses={self.listen} -c fsync=off "
                          f"-c max_connections=200", "start", timeout_s=90)
        return self

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server (``mode``: pg_ctl's smart / fast / immediate); a stopped one is left as it is."""
        if self.bindir is not None and (self.data / "postmaster.pid").exists():
            self._as_postgres(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-m", mode, "stop")

    def remove(self) -> None:
        """Stop the server and delete its folder."""
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def restart(self) -> None:
        """Stop (fast: every connection is cut) and start again on the same port and data."""
        self.stop("fast")
        self.start()

    def url(self, dbname: str = "postgres", host: str = "127.0.0.1") -> str:
        return f"postgresql://postgres@{host}:{self.port}/{dbname}"

    def create_database(self, name: str, host: str = "127.0.0.1") -> str:
        """A fresh database ``name``; returns its address."""
        import psycopg

        with psycopg.connect(self.url(host=host), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name, host)
