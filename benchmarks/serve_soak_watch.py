"""What ``serve_soak.py`` watches of its server: RSS and open fds from ``/proc`` over time, and ``/health``'s latency
every 0.5 s."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path


def proc_usage(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of process ``pid``, from ``/proc``."""
    rss_kib = int(re.search(r"^VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def open_files(pid: int) -> list[str]:
    """What the open fds of ``pid`` point at (``socket:[inode]`` for sockets), sorted."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append(re.sub(r"\[\d+\]$", "", os.readlink(f"/proc/{pid}/fd/{fd}")))
        except OSError:
            pass
    return sorted(found)


def diff(a: list[str], b: list[str]) -> list[str]:
    """The entries of ``a`` not in ``b``, counted (a multiset difference)."""
    left = list(b)
    return [x for x in a if not (x in left and not left.remove(x))]


class Watch:
    """A thread timing ``/health`` every 0.5 s and, while ``phase`` is set, sampling the server's (``pid``) RSS and
    fds every ``sample_s`` seconds into ``rows``, with the load's progress read from ``tally`` (its ``llm_done`` and
    ``videos_done`` counts)."""

    def __init__(self, base: str, pid: int, sample_s: float, tally):
        self.base, self.pid, self.sample_s, self.tally = base, pid, sample_s, tally
        self.health_max_s, self.health_bad = 0.0, []
        self.rows: list[list[str]] = []
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self, phase: str, settled: bool = False) -> tuple[float, int]:
        """One row; ``settled`` (an idle server): the fewest fds of 5 reads 0.2 s apart, so a client socket the
        server is still closing is not counted as held."""
        rss, fds = proc_usage(self.pid)
        for _ in range(4 if settled else 0):
            time.sleep(0.2)
            fds = min(fds, proc_usage(self.pid)[1])
        t = self.tally
        self.rows.append([f"{time.monotonic() - self.start:.0f}", phase, f"{rss:.1f}", str(fds), str(t.llm_done),
                          str(t.videos_done), f"{self.health_max_s * 1000:.0f}"])
        return rss, fds

    def _run(self) -> None:
        import httpx

        next_sample = time.monotonic() + self.sample_s
        with httpx.Client(base_url=self.base, timeout=10) as client:
            while not self._stop.wait(0.5):
                started = time.monotonic()
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                took = time.monotonic() - started
                self.health_max_s = max(self.health_max_s, took)
                if status != 200:
                    self.health_bad.append(f"{status} after {took:.2f} s")
                if not self.phase:
                    next_sample = time.monotonic() + self.sample_s
                elif time.monotonic() >= next_sample:
                    self.sample(self.phase)
                    next_sample += self.sample_s

    phase = ""

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)
