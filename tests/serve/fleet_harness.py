"""A video fleet on one machine for the tests and ``benchmarks/fleet_video.py``: hosts made as network namespaces
(``netns.Hosts``), one PostgreSQL server in the root namespace listening on every host's veth link, a shared clips
folder, and on each host its own ``metainfer-gen serve`` (one video worker) reaching PostgreSQL over the veth
address. :meth:`Fleet.close` stops the servers, PostgreSQL and the namespaces.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.serve.netns import Hosts
from tests.serve.postgres_cluster import PostgresCluster
from tests.serve.processes import stop_process, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
PORT = 8700  # every host has its own address, so all may use the same port
START_TIMEOUT_S = 240


class Fleet:
    """``num_hosts`` hosts sharing one queue and one clips folder.

    Args:
        model: the video pipeline folder every host serves.
        folder: where the clips folder and the servers' logs go.
        num_hosts: how many hosts. lease_s: the claims' lease. cpus: per host, the CPU list ``taskset`` pins its
            server (and so its worker) to, or None.
        extra: more ``serve`` flags for every host.
    """

    def __init__(self, model: Path, folder: Path, num_hosts: int = 2, lease_s: float = 3.0,
                 cpus: list[str] | None = None, extra: list[str] | None = None):
        self.model, self.folder, self.lease_s = Path(model), Path(folder), lease_s
        self.cpus, self.extra = cpus, extra or []
        self.clips = self.folder / "clips"
        self.clips.mkdir(parents=True, exist_ok=True)
        self.hosts = Hosts(num_hosts)
        self.procs: list[subprocess.Popen | None] = [None] * num_hosts
        try:
            listen = ",".join(["127.0.0.1", *(self.hosts.gateway(i) for i in range(num_hosts))])
            self.postgres = PostgresCluster(listen=listen).start()
            self.store_url = self.postgres.create_database("fleet")
        except BaseException:
            self.hosts.remove()
            raise

    def host_store_url(self, i: int) -> str:
        """The store's address as host ``i`` reaches it (over its veth link)."""
        return self.store_url.replace("@127.0.0.1:", f"@{self.hosts.gateway(i)}:")

    def url(self, i: int) -> str:
        return f"http://{self.hosts.address(i)}:{PORT}"

    def start(self, i: int) -> None:
        """Start host ``i``'s server (returns once it answers /health)."""
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        command = [sys.executable, "-m", "metainfer_gen.apps.cli", "serve", "--llm", "none", "--video",
                   str(self.model), "--host", "0.0.0.0", "--port", str(PORT), "--job-store", self.host_store_url(i),
                   "--clips-dir", str(self.clips), "--data-dir", str(self.folder / f"data{i}"), "--video-workers",
                   "1", "--video-threads", "1", "--video-device", "cpu", "--video-max-size", "64",
                   "--lease-seconds", str(self.lease_s), "--log-level", "warning", *self.extra]
        if self.cpus:
            command = ["taskset", "-c", self.cpus[i], *command]
        log = open(self.folder / f"host{i}.log", "a")
        self.procs[i] = subprocess.Popen(self.hosts.command(i, command), cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        log.close()
        wait_healthy(self.url(i), self.procs[i], self.folder / f"host{i}.log", START_TIMEOUT_S)

    def wait_workers_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every started host's worker has loaded the model (its ``ready:`` key is in the store)."""
        from metainfer_gen.serve.video.stores import open_job_store
        from metainfer_gen.serve.video.worker import ready_key

        store = open_job_store(self.store_url)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                live = [p.pid for p in self.procs if p is not None and p.poll() is None]
                if all(store.get_meta(ready_key(f"{socket.gethostname()}-{pid}/0")) is not None for pid in live):
                    return
                time.sleep(0.3)
        finally:
            store.close()
        raise AssertionError("the hosts' workers did not load the model in time")

    def host_of(self, owner: str) -> int:
        """The host whose server started the worker ``owner`` (``<hostname>-<pid>/<index>``)."""
        pid = int(owner.rsplit("/", 1)[0].rsplit("-", 1)[1])
        return next(i for i, p in enumerate(self.procs) if p is not None and p.pid == pid)

    def kill(self, i: int) -> list[int]:
        """``kill -9`` every process of host ``i``; returns their pids."""
        pids = self.hosts.kill_all(i)
        if self.procs[i] is not None:
            self.procs[i].wait(10)
        return pids

    def pause(self, i: int) -> None:
        """Freeze every process of host ``i`` (SIGSTOP): its workers take and finish no job until :meth:`resume`."""
        self.hosts.signal_all(i, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """Let host ``i``'s processes run again (SIGCONT)."""
        self.hosts.signal_all(i, signal.SIGCONT)

    def close(self) -> None:
        for proc in self.procs:
            if proc is not None:
                stop_process(proc)
        self.postgres.remove()
        self.hosts.remove()
