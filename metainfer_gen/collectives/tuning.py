"""All-reduce thresholds measured once per machine and cached as JSON under the user cache directory.

The choice between one-shot and two-shot depends on the memory system, so it is measured, not guessed: the ranks
time both algorithms over message sizes from 4 KB to 16 MB, take the largest size at which one-shot still wins as
``one_shot_max_bytes``, and time chunk sizes for large messages. Group rank 0 decides and writes the cache; every
rank gets rank 0's answer, so the ranks never disagree on an algorithm.

Cache file: ``$METAINFER_COLLECTIVES_CACHE`` if set, else ``$XDG_CACHE_HOME/metainfer_gen/collectives.json``
(``~/.cache/...``). Entries are keyed by host, CPU model, core count, group size and torch version.
``METAINFER_COLLECTIVES_TUNE=0`` skips measuring when there is no entry (the defaults below apply, with
``source="default"``). Re-measure with::

    python -m metainfer_gen.collectives.retune --world-size 2
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["CACHE_ENV", "TUNE_ENV", "UNBOUNDED", "Thresholds", "cache_path", "load_or_measure", "machine_key",
           "main", "measure", "write_cache"]

CACHE_ENV = "METAINFER_COLLECTIVES_CACHE"
TUNE_ENV = "METAINFER_COLLECTIVES_TUNE"
_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
_CHUNKS = [256 << 10, 1 << 20, 4 << 20]
UNBOUNDED = 1 << 62


@dataclass(slots=True)
class Thresholds:
    """Which shared-memory algorithm serves which message size.

    Attributes:
        one_shot_max_bytes: messages up to this many bytes use one-shot, longer ones two-shot.
        chunk_bytes: bytes per round for messages longer than one slot.
        source: "measured", "cache" or "default".
        measured_at: UTC time of the measurement (ISO 8601), "" for defaults.
        timings_us: size in bytes -> {"one_shot": us, "two_shot": us} as measured on group rank 0.
    """

    one_shot_max_bytes: int = 256 << 10
    chunk_bytes: int = 1 << 20
    source: str = "default"
    measured_at: str = ""
    timings_us: dict = field(default_factory=dict)

    def describe(self) -> str:
        """One line for logs and tables: the threshold, the chunk, where the numbers came from."""
        when = f" {self.measured_at}" if self.measured_at else ""
        limit = "any size" if self.one_shot_max_bytes >= UNBOUNDED else f"<= {self.one_shot_max_bytes} B"
        return f"one-shot {limit}, chunk {self.chunk_bytes} B ({self.source}{when})"


def cache_path() -> Path:
    """Where the thresholds JSON lives (see the module docstring)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "metainfer_gen" / "collectives.json"


def machine_key(world_size: int) -> str:
    """The cache key: host, CPU model, cores, group size, torch version."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{socket.gethostname()}|{cpu}|{os.cpu_count()}cpu|world{world_size}|torch{torch.__version__}"


def _read_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def write_cache(key: str, t: Thresholds) -> None:
    """Store ``t`` under ``key`` in the cache file (other keys kept; atomic replace)."""
    path = cache_path()
    data = _read_cache()
    data[key] = asdict(t)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file, never half of one


def _time_us(fns: dict, x, iters: int, reps: int = 5) -> dict:
    """Best (over ``reps``) mean time per call in us of each ``fn(x)``; the contenders' batches alternate, and the
    minimum is taken because interference from other processes only ever adds time."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn(x)  # warm-up
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn(x)
            best[name] = min(best[name], (time.perf_counter() - start) / iters * 1e6)
    return best


def measure(comm, sizes: list[int] | None = None, chunks: list[int] | None = None) -> Thresholds:
    """Time one-shot vs two-shot and the chunk sizes on ``comm`` (collective: every rank of its group calls it).

    Args:
        sizes: message sizes in bytes, ascending (default 4 KB .. 16 MB).
        chunks: chunk sizes in bytes to try on the largest message (default 256 KB, 1 MB, 4 MB; those above the
            communicator's slot are skipped).
    Every rank runs the same loop, so the rounds stay matched; the caller keeps group rank 0's numbers.
    """
    import torch

    sizes, chunks = sizes or _SIZES, chunks or _CHUNKS
    timings: dict = {}
    one_shot_max, one_shot_winning = 0, True
    algos = {"one_shot": comm.all_reduce_one_shot, "two_shot": comm.all_reduce_two_shot}
    for size in sizes:
        row = _time_us(algos, torch.ones(size // 4), iters=10 if size <= (1 << 20) else 2)
        timings[str(size)] = row
        # the threshold is the end of the first run of sizes where one-shot wins (noise past it is ignored)
        one_shot_winning = one_shot_winning and row["one_shot"] <= row["two_shot"]
        if one_shot_winning:
            one_shot_max = size
    if one_shot_winning:
        one_shot_max = UNBOUNDED  # one-shot won at every measured size: no reason to switch beyond them
    # Both algorithms at every chunk size: each rank must run the same rounds whatever its own timings say.
    big = torch.ones(sizes[-1] // 4)
    use = "one_shot" if one_shot_max >= sizes[-1] else "two_shot"
    best_chunk, best_t = min(chunks[0], comm.slot_bytes), float("inf")
    for chunk in (c for c in chunks if c <= comm.slot_bytes):
        row = _time_us({name: (lambda v, c=chunk, f=fn: f(v, c)) for name, fn in algos.items()}, big, iters=1,
                       reps=3)
        timings[f"chunk{chunk}"] = row
        if row[use] < best_t:
            best_chunk, best_t = chunk, row[use]
    return Thresholds(one_shot_max_bytes=one_shot_max, chunk_bytes=best_chunk, source="measured",
                      measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), timings_us=timings)


def load_or_measure(comm, group, force: bool = False, tune: bool | None = None) -> Thresholds:
    """The thresholds for ``comm``'s group: rank 0 reads the cache, measures (all ranks) when missing or ``force``.

    Collective over ``group``. ``tune=False`` takes the defaults instead of measuring when nothing is cached (None
    reads ``METAINFER_COLLECTIVES_TUNE``). Returns the same :class:`Thresholds` on every rank.
    """
    import torch.distributed as dist

    key = machine_key(comm.world_size)
    cached = None
    if comm.rank == 0 and not force:
        entry = _read_cache().get(key)
        if entry:
            try:
                cached = Thresholds(**{**entry, "source": "cache"})
            except TypeError:
                cached = None  # an entry from an older layout: measure again
    decision: list = [None] * comm.world_size
    if tune is None:
        tune = os.environ.get(TUNE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    tune = force or tune
    dist.all_gather_object(decision, (cached is not None, tune), group=group)
    have_cache, tune = decision[0]
    if have_cache:
        result = cached
    elif tune:
        result = measure(comm)
        if comm.rank == 0:
            write_cache(key, result)
    else:
        result = Thresholds()
    out: list = [None] * comm.world_size
    dist.all_gather_object(out, asdict(result) if comm.rank == 0 else None, group=group)
    return Thresholds(**out[0])
