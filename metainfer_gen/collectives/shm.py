"""Same-host shared-memory segments and the rank-to-rank signalling over them.

A :class:`ShmSegment` is a POSIX shared-memory file under ``/dev/shm`` mapped into every rank of a group. Its name
is unique per job and creator (``mig-coll-<job>-<tag>-<creator pid>-<random>``) and it is **unlinked as soon as
every rank has attached** (:meth:`ShmSegment.unlink`): from then on the mapping lives only as long as the processes
do, so neither a clean exit nor a crash (SIGKILL included) leaves a file behind. A crash inside the short window
between create and unlink is covered by :func:`sweep_stale_segments`, run before every create: it removes our
segments whose creator pid is gone.

A :class:`ShmChannel` lays out one 64-byte header line per rank (sequence counter, message size, dtype and op
codes, pid) plus an abort word, and implements the only synchronisation the algorithms need: post my sequence
number, wait until every peer has posted it. Waits spin briefly, yield briefly, then sleep on a futex that the poster
wakes, and never last longer than ``timeout_s``; a dead peer (pid gone or zombie) or an abort posted by any rank makes
the wait raise at once, and a rank that times out posts the abort so that its peers raise too instead of each waiting
out its own timeout.

Memory ordering: the header words are aligned 8-byte stores and loads through numpy, which x86-64 (TSO) keeps in
program order relative to the data copies before them. Weakly ordered CPUs (ARM) would need explicit fences; the
communicator refuses the shared-memory path there (see :mod:`metainfer_gen.collectives.communicator`).

Sources followed: vLLM's ``shm_broadcast.py`` and SGLang's CPU shared-memory all-reduce (flag per rank, data slots
per rank), with their hard-coded names and unbounded spins replaced by unique names, unlink-after-attach and
timeouts.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import time

import numpy as np

from metainfer_gen.collectives import futex as _futex

__all__ = ["CollectiveAborted", "CollectiveTimeout", "SHM_DIR", "SHM_PREFIX", "ShmChannel", "ShmSegment",
           "list_segments", "sweep_stale_segments"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mig-coll-"
_NAME_RE = re.compile(rf"^{SHM_PREFIX}[A-Za-z0-9_.]+-[A-Za-z0-9_.]+-(\d+)-[0-9a-f]+$")

HEADER_LINE = 64  # bytes per rank: one cache line, so ranks never write into the same line
# int64 words inside a rank's header line: the counter, then the description of the message posted with an even
# and with an odd counter. A peer is at most one post ahead of a rank still checking round k (it needs that rank's
# post k + 1 before it can post k + 2), so the description of post k is intact while it is read.
SEQ, DESC = 0, 1
_ABORT_WORDS = 8  # the line after the rank lines: [abort flag, aborting rank]
SPIN_S = 20e-6  # busy-wait this long first: a round trip between ranks that both hold a core is microseconds
YIELD_S = 1e-3  # then yield the core but stay runnable this long (measured 2x faster than sleeping at once when
# the cores are oversubscribed); then sleep on the futex, so a rank waiting on a slow peer costs no CPU
SLICE_S = 0.02  # longest single sleep: the abort flag, liveness and deadline are checked this often


class CollectiveTimeout(RuntimeError):
    """A peer did not reach the same collective within the timeout, or died; the communicator is now unusable."""


class CollectiveAborted(CollectiveTimeout):
    """Another rank gave up (timeout, death of a third rank, mismatched call) and posted the abort flag."""


def _job_key() -> str:
    # torchrun sets TORCHELASTIC_RUN_ID; a plain mp.spawn job is keyed by the launching process.
    raw = os.environ.get("TORCHELASTIC_RUN_ID") or f"ppid{os.getppid()}"
    return re.sub(r"[^A-Za-z0-9_.]", "_", raw)[:24] or "job"


def _pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie (a killed child that its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def list_segments() -> list[str]:
    """Names of this package's segments currently present in ``/dev/shm`` (normally none: they are unlinked early)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX))
    except OSError:
        return []


def sweep_stale_segments() -> list[str]:
    """Unlink our segments whose creator process is gone (a job killed between create and unlink).

    Returns:
        the names removed.
    """
    removed = []
    for name in list_segments():
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class ShmSegment:
    """A named shared-memory mapping: created by one rank, attached by the others, then unlinked.

    Args:
        nbytes: size of the mapping in bytes.
        name: attach to this existing segment; None creates a new one.
        tag: a short label inside the created name (process-group id).
    Raises:
        OSError: ``/dev/shm`` missing or full, or the named segment does not exist (another mount namespace).
    """

    def __init__(self, nbytes: int, name: str | None = None, tag: str = "g"):
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1; got {nbytes}")
        self.nbytes = nbytes
        self.created = name is None
        if self.created:
            sweep_stale_segments()
            name = f"{SHM_PREFIX}{_job_key()}-{tag}-{os.getpid()}-{secrets.token_hex(4)}"
            fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            except OSError:
                os.close(fd)
                os.unlink(os.path.join(SHM_DIR, name))
                raise
        else:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        self.name = name
        try:
            self.buffer = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._linked = self.created

    def unlink(self) -> None:
        """Remove the name (the creator calls this once every rank has attached); the mappings stay valid."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink if still linked and drop the mapping (views into it must be gone first, or it stays mapped)."""
        self.unlink()
        try:
            self.buffer.close()
        except BufferError:
            pass  # numpy/torch views still alive: the mapping is released when they are collected

    def __repr__(self) -> str:
        return f"ShmSegment({self.name!r}, {self.nbytes} B, linked={self._linked})"


class ShmChannel:
    """Headers and signalling for ``world_size`` ranks at the start of a segment.

    Args:
        buffer: the segment mapping (at least :meth:`header_bytes` long).
        rank / world_size: this rank's index within the group and the group size.
        pids: the process id of every rank (for the death check).
        timeout_s: longest wait for a peer, in seconds.
    """

    def __init__(self, buffer, rank: int, world_size: int, pids: list[int], timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.pids = list(pids)
        words = self.header_bytes(world_size) // 8
        self._words = np.frombuffer(buffer, dtype=np.int64, count=words)
        self.headers = self._words[: world_size * 8].reshape(world_size, 8)
        self._abort = self._words[world_size * 8:]
        self._base = self._words.ctypes.data
        self.peers = [r for r in range(world_size) if r != rank]
        # Ranks in another PID namespace (containers sharing /dev/shm) have pids this process cannot see: then only
        # the timeout and the abort flag detect a lost peer.
        self.watch_pids = all(_pid_alive(self.pids[p]) for p in self.peers)
        self.seq = int(self.headers[rank, SEQ])
        self.broken: str | None = None

    @staticmethod
    def header_bytes(world_size: int) -> int:
        """Bytes the headers take: one line per rank plus the abort line."""
        return HEADER_LINE * world_size + _ABORT_WORDS * 8

    def post(self, numel: int = 0, dtype_code: int = 0, opcode: int = 0) -> int:
        """Publish the next sequence number with the message description; data must be written before this call.

        Returns:
            the sequence number posted.
        Raises:
            CollectiveAborted: the channel is broken (an earlier wait failed here or on a peer).
        """
        self.check_usable()
        self.seq += 1
        hdr = self.headers[self.rank]
        d = DESC + 3 * (self.seq & 1)
        hdr[d], hdr[d + 1], hdr[d + 2] = numel, dtype_code, opcode
        hdr[SEQ] = self.seq  # last: peers read the description only after seeing this
        _futex.wake(self._seq_address(self.rank))
        return self.seq

    def check_usable(self) -> None:
        """Raise when this channel or a peer gave up; nothing can be sent on it afterwards."""
        if self.broken is None and self._abort[0]:
            self.broken = f"rank {int(self._abort[1])} aborted the collective"
        if self.broken is not None:
            raise CollectiveAborted(f"shared-memory communicator is unusable: {self.broken}; re-initialise the "
                                    f"process group")

    def wait(self, seq: int | None = None) -> None:
        """Block until every peer has posted ``seq`` (default: this rank's latest), or raise.

        Spins for about :data:`SPIN_S` seconds, yields the core until :data:`YIELD_S`, then sleeps on the peer's
        counter word (a futex, woken by :meth:`post`) in slices of at most :data:`SLICE_S`, checking the abort flag, the
        peers' liveness and the deadline between slices. Sleeping instead of spinning matters when ranks share cores
        with other work.

        Raises:
            CollectiveTimeout: a peer did not post within ``timeout_s`` seconds, or its process is gone.
            CollectiveAborted: a peer posted the abort flag.
        """
        seq = self.seq if seq is None else seq
        headers, abort = self.headers, self._abort
        pending = [p for p in self.peers if headers[p, SEQ] < seq]
        if not pending:
            return
        start = time.perf_counter()
        while time.perf_counter() - start < SPIN_S:
            pending = [p for p in pending if headers[p, SEQ] < seq]
            if not pending:
                return
        while time.perf_counter() - start < YIELD_S:
            os.sched_yield()  # stay runnable: on a busy machine a sleeper waits long to be scheduled again
            pending = [p for p in pending if headers[p, SEQ] < seq]
            if not pending:
                return
        deadline = time.monotonic() + self.timeout_s
        while True:
            pending = [p for p in pending if headers[p, SEQ] < seq]
            if not pending:
                return
            if abort[0]:
                self.check_usable()
            now = time.monotonic()
            dead = [p for p in pending if self.watch_pids and not _pid_alive(self.pids[p])]
            if dead or now > deadline:
                why = (f"rank {dead[0]} (pid {self.pids[dead[0]]}) died" if dead else
                       f"rank {pending[0]} did not reach collective #{seq} within {self.timeout_s:g} s")
                self.abort(why)
                raise CollectiveTimeout(f"shared-memory collective failed on rank {self.rank}: {why}")
            p = pending[0]
            observed = int(headers[p, SEQ])
            if observed < seq:
                _futex.wait(self._seq_address(p), observed, min(SLICE_S, max(deadline - now, 0.0) + 1e-3))

    def _seq_address(self, rank: int) -> int:
        return self._base + rank * HEADER_LINE + SEQ * 8

    def peer_header(self, peer: int, seq: int | None = None) -> tuple[int, int, int]:
        """``(numel, dtype code, op code)`` the peer posted with sequence number ``seq`` (default: this rank's).

        Valid once :meth:`wait` for ``seq`` returned and until this rank posts again.
        """
        seq = self.seq if seq is None else seq
        h = self.headers[peer]
        d = DESC + 3 * (seq & 1)
        return int(h[d]), int(h[d + 1]), int(h[d + 2])

    def abort(self, why: str) -> None:
        """Mark the channel broken here and tell every peer (their next or current wait raises)."""
        self.broken = why
        self._abort[1] = self.rank
        self._abort[0] = 1
        _futex.wake(self._seq_address(self.rank))

    def release(self) -> None:
        """Drop the numpy views (before the segment is closed)."""
        self._words = self.headers = self._abort = None  # type: ignore[assignment]
