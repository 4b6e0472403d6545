"""The fast-path audit: which implementation ran at each call site, and why every faster one was refused.

Entries are keyed by ``(op, site, path, refusals)`` and counted, so a loop that calls an op a million times from
one line makes one entry with ``num_calls == 1_000_000``, not a million entries. Every dispatch records into the
process-wide audit (:func:`global_audit`) and into each collector opened with :func:`audit` around it, so a
pipeline call can be wrapped to get the summary of the paths it took::

    with audit() as report:
        pipe("a red circle moving right", num_inference_steps=2)
    print(report.summary())

Collectors live in a ``contextvars.ContextVar``: threads and asyncio tasks see only the collectors they opened.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Audit", "AuditEntry", "Refusal", "audit", "global_audit", "record"]

# A long-running server with shape-dependent reasons could otherwise grow the process-wide audit without bound.
MAX_GLOBAL_ENTRIES = 4096


@dataclass(frozen=True, slots=True)
class Refusal:
    """One faster implementation that did not apply, and why (``"dtype torch.float64 not in (...)"``)."""

    implementation: str
    reason: str

    def __str__(self) -> str:
        return f"{self.implementation}: {self.reason}"


@dataclass(slots=True)
class AuditEntry:
    op: str
    site: str  # "file.py:123 (function)" or a name given by the caller ("WanTransformerBlock.norm1")
    path: str  # the implementation that ran
    refusals: tuple[Refusal, ...]  # faster implementations refused, fastest first
    num_calls: int = 0

    @property
    def fast_path(self) -> bool:
        """True when the fastest registered implementation ran."""
        return not self.refusals

    def to_dict(self) -> dict:
        return {"op": self.op, "site": self.site, "path": self.path, "num_calls": self.num_calls,
                "refusals": [{"implementation": r.implementation, "reason": r.reason} for r in self.refusals]}


class Audit:
    """A counted set of :class:`AuditEntry`, thread-safe."""

    def __init__(self, max_entries: int | None = None):
        self._entries: dict[tuple, AuditEntry] = {}
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.num_dropped = 0  # calls not recorded because max_entries was reached

    def record(self, op: str, site: str, path: str, refusals: tuple[Refusal, ...] = ()) -> None:
        key = (op, site, path, refusals)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if self.max_entries is not None and len(self._entries) >= self.max_entries:
                    self.num_dropped += 1
                    return
                entry = self._entries[key] = AuditEntry(op, site, path, refusals)
            entry.num_calls += 1

    @property
    def entries(self) -> list[AuditEntry]:
        with self._lock:
            return list(self._entries.values())

    @property
    def num_calls(self) -> int:
        return sum(e.num_calls for e in self.entries)

    def paths(self) -> dict[str, dict[str, int]]:
        """op -> {implementation that ran: number of calls}."""
        out: dict[str, dict[str, int]] = {}
        for e in self.entries:
            out.setdefault(e.op, {}).setdefault(e.path, 0)
            out[e.op][e.path] += e.num_calls
        return out

    def refusals(self) -> dict[str, set[str]]:
        """op -> distinct ``"implementation: reason"`` strings."""
        out: dict[str, set[str]] = {}
        for e in self.entries:
            out.setdefault(e.op, set()).update(str(r) for r in e.refusals)
        return out

    @property
    def all_fast(self) -> bool:
        return all(e.fast_path for e in self.entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_dropped = 0

    def to_dict(self) -> list[dict]:
        return [e.to_dict() for e in self.entries]

    def summary(self) -> str:
        """A short table: one line per (op, site, path), its call count, then each refusal indented."""
        entries = sorted(self.entries, key=lambda e: (e.op, e.site, e.path))
        if not entries:
            return "fast-path audit: no kernel dispatches recorded"
        lines = [f"fast-path audit: {sum(e.num_calls for e in entries)} calls at {len({e.site for e in entries})} "
                 f"sites"]
        for e in entries:
            lines.append(f"  {e.op:<20} {e.path:<9} x{e.num_calls:<6} {e.site}")
            lines.extend(f"      refused {r}" for r in e.refusals)
        if self.num_dropped:
            lines.append(f"  ({self.num_dropped} calls not itemised: more than {self.max_entries} distinct entries)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Audit({len(self._entries)} entries, {self.num_calls} calls)"


_GLOBAL = Audit(max_entries=MAX_GLOBAL_ENTRIES)
_COLLECTORS: contextvars.ContextVar[tuple[Audit, ...]] = contextvars.ContextVar("metainfer_audit", default=())


def global_audit() -> Audit:
    """The process-wide audit of every dispatch since start (or since its ``clear()``)."""
    return _GLOBAL


def record(op: str, site: str, path: str, refusals: tuple[Refusal, ...] = ()) -> None:
    """Count one call in the process-wide audit and in every open :func:`audit` collector.

    Used by :mod:`metainfer_gen.kernels.registry`; also public so that code deciding between paths by other
    means (collectives, fused-module fallbacks) reports into the same audit.
    """
    _GLOBAL.record(op, site, path, refusals)
    for collector in _COLLECTORS.get():
        collector.record(op, site, path, refusals)


@contextlib.contextmanager
def audit() -> Iterator[Audit]:
    """Collect the dispatches made inside the block (nested collectors each see everything inside them).

    Example:
        >>> from metainfer_gen import kernels
        >>> import torch
        >>> with kernels.audit() as report:
        ...     _ = kernels.rms_norm(torch.randn(4, 64), torch.ones(64))
        >>> list(report.paths())
        ['rms_norm']
    """
    collector = Audit()
    token = _COLLECTORS.set(_COLLECTORS.get() + (collector,))
    try:
        yield collector
    finally:
        _COLLECTORS.reset(token)
