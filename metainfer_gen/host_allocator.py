"""The host allocator the engine runs under: tcmalloc where installed, else glibc's malloc tuned to keep its pages.

An eager CPU step frees and reallocates thousands of tensors, many of them megabytes. glibc's malloc maps big
blocks fresh and hands freed memory back to the kernel (trim), so the next step page-faults the same megabytes in
again: on a 2-core AMD EPYC (avx512_bf16) our C=64 bf16 batch of the random DeepSeek-V3 took 7.9-9.8 s under plain
glibc, 6.0-7.2 s under tcmalloc and 6.3-7.4 s under glibc with ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_``
(``benchmarks/llm_allocator.py``). vLLM's CPU docs ask users to ``LD_PRELOAD`` tcmalloc for the same reason.

Both settings are read when the process starts, so they cannot be applied from inside a running interpreter: the
``metainfer-gen`` command re-executes itself once under :func:`allocator_env` (the way ``torchrun`` or Intel's
``ipexrun`` launch a worker), and benchmarks start their engine processes with it. ``METAINFER_HOST_ALLOCATOR``
chooses: ``auto`` (default: tcmalloc if found, else tuned glibc), ``tcmalloc``, ``glibc-tuned`` or ``system``
(the environment as it is). :func:`current_allocator` says which one this process got (``doctor`` prints it).
"""

from __future__ import annotations

import os
import platform as _platform
import sys
from pathlib import Path
from typing import Mapping

__all__ = ["ALLOCATOR_ENV", "GLIBC_TUNING", "allocator_env", "current_allocator", "find_tcmalloc", "reexec",
           "without_ours"]

ALLOCATOR_ENV = "METAINFER_HOST_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "glibc-tuned", "system")
# glibc keeps up to 4 GiB of freed memory at the top of the heap and grows it 256 MiB at a time; setting either
# also fixes the mmap threshold (no dynamic growth), as ``mallopt(3)`` documents.
GLIBC_TUNING = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_TOP_PAD_": str(256 << 20)}
# tcmalloc prints a line per allocation over 1 GiB by default (loading a checkpoint makes several).
TCMALLOC_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}
_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc(dirs: tuple[str, ...] = _LIB_DIRS) -> Path | None:
    """The first tcmalloc shared library in the usual system library folders (Debian's ``libtcmalloc-minimal4``,
    RHEL's ``gperftools-libs``), or None."""
    for folder in dirs:
        for name in _TCMALLOC_NAMES:
            path = Path(folder) / name
            if path.exists():
                return path
    return None


def _is_glibc() -> bool:
    return _platform.system() == "Linux" and _platform.libc_ver()[0] == "glibc"


def allocator_env(environ: Mapping[str, str] | None = None,
                  lib_dirs: tuple[str, ...] = _LIB_DIRS) -> dict[str, str] | None:
    """The environment a process should start with to get the fast allocator, or None when ``environ`` (default:
    this process's) already has it or asks for none (``METAINFER_HOST_ALLOCATOR=system``, an ``LD_PRELOAD`` of
    an allocator, under ``auto`` any ``MALLOC_*`` setting of the user's, or not Linux with glibc).

    Args:
        environ: the environment to start from.
        lib_dirs: where to look for tcmalloc (:func:`find_tcmalloc`).
    Returns:
        ``environ`` plus ``LD_PRELOAD`` (tcmalloc prepended) or the glibc tuning, and ``METAINFER_HOST_ALLOCATOR``
        set to the choice made (so a re-executed process does not choose again).
    Raises:
        ValueError: ``METAINFER_HOST_ALLOCATOR`` is not one of ``auto``, ``tcmalloc``, ``glibc-tuned``, ``system``,
            or asks for tcmalloc where none is installed.
    """
    env = dict(os.environ if environ is None else environ)
    choice = env.get(ALLOCATOR_ENV) or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ALLOCATOR_ENV}={choice!r}: choose one of {', '.join(CHOICES)}")
    preload = env.get("LD_PRELOAD", "")
    if choice == "system" or env.get("METAINFER_HOST_ALLOCATOR_SET") or not _is_glibc():
        return None
    if any(lib in preload for lib in ("tcmalloc", "jemalloc", "mimalloc")):
        return None  # an allocator is preloaded already
    if choice == "auto" and any(k.startswith("MALLOC_") for k in env):
        return None  # the user tuned glibc: theirs stands
    library = find_tcmalloc(lib_dirs)
    if choice == "tcmalloc" and library is None:
        raise ValueError(f"{ALLOCATOR_ENV}=tcmalloc but no tcmalloc was found in {', '.join(lib_dirs)}: "
                         f"apt-get install libtcmalloc-minimal4 (or dnf install gperftools-libs)")
    env["METAINFER_HOST_ALLOCATOR_SET"] = "1"
    if library is not None and choice in ("auto", "tcmalloc"):
        env["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
        env.update({k: v for k, v in TCMALLOC_QUIET.items() if k not in env})
        env[ALLOCATOR_ENV] = "tcmalloc"
    else:
        env.update(GLIBC_TUNING)
        env[ALLOCATOR_ENV] = "glibc-tuned"
    return env


def current_allocator() -> str:
    """The allocator this process runs under, from its mapped libraries and environment: ``"tcmalloc"``,
    ``"jemalloc"``, ``"mimalloc"``, ``"glibc malloc (tuned: MALLOC_...)"`` or ``"glibc malloc"`` (or the platform's
    own where ``/proc/self/maps`` is missing)."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"the platform's ({_platform.system()})"
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if f"lib{name}" in maps:
            return name
    tuned = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    return f"glibc malloc (tuned: {', '.join(tuned)})" if tuned else "glibc malloc"


def reexec() -> None:
    """Replace this process by the same command line (``sys.orig_argv``: the interpreter's options and the script
    unchanged) under :func:`allocator_env`, where that differs from the environment it has; returns otherwise.
    Call it first thing in a program's ``main``, before any work. Exits with the message where
    ``METAINFER_HOST_ALLOCATOR`` is invalid."""
    try:
        env = allocator_env()
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def without_ours(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less what :func:`allocator_env` added (for a peer that should run with its own defaults)."""
    env = dict(environ)
    if env.pop("METAINFER_HOST_ALLOCATOR_SET", None):
        env.pop(ALLOCATOR_ENV, None)
        for key in (*GLIBC_TUNING, *TCMALLOC_QUIET):
            env.pop(key, None)
        preload = [p for p in env.pop("LD_PRELOAD", "").split(":") if p and "tcmalloc" not in p]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    return env
