"""Cross-process sleep/wake on a 32-bit word in shared memory: Linux ``futex(2)`` through ctypes.

``wait(addr, expected, timeout_s)`` sleeps while the low 32 bits at ``addr`` equal ``expected`` (up to the
timeout; spurious wake-ups are fine, callers re-check); ``wake(addr)`` wakes every sleeper on ``addr``. The futex
ops are the shared (non-``PRIVATE``) ones so they work across processes mapping the same segment. Where the
syscall is unavailable (not Linux x86-64/aarch64), ``wait`` sleeps a short fixed time and ``wake`` does nothing,
which is slower but correct. ctypes releases the GIL around the call.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

__all__ = ["available", "wait", "wake"]

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_INT_MAX = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load():
    if _SYS_FUTEX is None or os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load()


def available() -> bool:
    """True when the futex syscall is used (else the fallback sleeps)."""
    return _syscall is not None


def wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep until woken, the word at ``addr`` differs from ``expected`` (low 32 bits), or ``timeout_s`` passes."""
    if _syscall is None:
        time.sleep(min(timeout_s, 50e-6))
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF),
             ctypes.byref(ts), None, 0)


def wake(addr: int) -> None:
    """Wake every process sleeping in :func:`wait` on ``addr``."""
    if _syscall is not None:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _INT_MAX, None, None, 0)
