"""Hosts made as Linux network namespaces for the fleet tests (root only): each host gets its own namespace, joined
to this (the root) namespace by a veth pair on a /24 of its own. The host sees itself at ``10.B.i.2`` and the root
side, where the test's PostgreSQL listens, at ``10.B.i.1``. Nothing leaves the machine. :meth:`Hosts.remove` kills
every process left in the namespaces and deletes them (the veth pairs go with them).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess


def can_make_namespaces() -> str | None:
    """None when this process can make network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """``count`` namespaces named ``<prefix><pid>-<i>``.

    Args:
        count: how many hosts.
        prefix: short name prefix (veth names are at most 15 characters).
    Raises:
        subprocess.CalledProcessError: ``ip`` refused (the namespaces made so far are removed first).
    """

    def __init__(self, count: int = 2, prefix: str = "mg"):
        tag = os.getpid() % 100000
        self.block = 200 + tag % 50  # the second octet: 10.<block>.<i>.0/24 per host
        self.names = [f"{prefix}{tag}-{i}" for i in range(count)]
        self._veths: list[str] = []
        try:
            for i, name in enumerate(self.names):
                outside, inside = f"{prefix}{tag}o{i}", f"{prefix}{tag}i{i}"
                _ip("netns", "add", name)
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                self._veths.append(outside)
                _ip("link", "set", inside, "netns", name)
                _ip("addr", "add", f"{self.gateway(i)}/24", "dev", outside)
                _ip("link", "set", outside, "up")
                _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", inside)
                _ip("-n", name, "link", "set", inside, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise

    def address(self, i: int) -> str:
        """Host ``i``'s own address (reachable from the root namespace)."""
        return f"10.{self.block}.{i}.2"

    def gateway(self, i: int) -> str:
        """The root namespace's address on host ``i``'s link (where host ``i`` reaches PostgreSQL)."""
        return f"10.{self.block}.{i}.1"

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``i`` (``ip netns exec`` execs it: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def pids(self, i: int) -> list[int]:
        """Every process in host ``i``'s namespace."""
        done = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True, text=True, timeout=30)
        return [int(p) for p in done.stdout.split()]

    def signal_all(self, i: int, sig: int) -> list[int]:
        """Send ``sig`` to every process of host ``i``; returns their pids."""
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def kill_all(self, i: int) -> list[int]:
        """``kill -9`` every process of host ``i``; returns their pids."""
        return self.signal_all(i, signal.SIGKILL)

    def remove(self) -> None:
        """Kill what runs in the namespaces and delete them and their veth pairs; safe to call twice."""
        for i, name in enumerate(self.names):
            if os.path.exists(f"/run/netns/{name}"):
                self.kill_all(i)
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        for veth in self._veths:  # gone with their namespace already, unless the move into it failed
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        self._veths = []
