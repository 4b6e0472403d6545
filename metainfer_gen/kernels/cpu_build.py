"""C++ CPU kernels built once per machine: compiled on first use for the running CPU's instruction set, cached on
disk, loaded in every later process in well under a second.

A kernel is one source file under ``kernels/csrc/`` with a pybind11 module (``torch.utils.cpp_extension``, as
PyTorch's own extension tutorial and vLLM's CPU build compile theirs). It is built with ``-O3 -march=native`` into
``$METAINFER_CPU_KERNEL_CACHE`` (default ``~/.cache/metainfer_gen/cpu_kernels``), in a folder keyed by the source,
torch's and Python's versions and the CPU's flags, so a checkout moved to another CPU builds afresh rather than
running instructions that machine lacks. ``METAINFER_CPU_KERNELS=0`` turns every C++ kernel off (the torch paths run
and the audit says why). A build that fails (no compiler, no ninja) is a refusal with the compiler's last lines,
never an error: callers fall back to their torch path. A build killed half-way leaves nothing that blocks the next.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from metainfer_gen.platform import cpu_flags

__all__ = ["CACHE_ENV", "DISABLE_ENV", "build_key", "cache_dir", "ensure_built", "load_built"]

CACHE_ENV = "METAINFER_CPU_KERNEL_CACHE"
DISABLE_ENV = "METAINFER_CPU_KERNELS"
SOURCES = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-DNDEBUG")

log = logging.getLogger(__name__)
_lock = threading.Lock()
_built: dict[str, tuple[ModuleType | None, str | None]] = {}


def cache_dir() -> Path:
    """Where built kernels live: ``$METAINFER_CPU_KERNEL_CACHE`` or ``~/.cache/metainfer_gen/cpu_kernels``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "metainfer_gen" / "cpu_kernels"


def build_key(name: str) -> str:
    """16 hex digits naming one build of ``csrc/<name>.cpp``: its text and the headers beside it, the compiler flags,
    torch's and Python's versions and the CPU's flags. Raises FileNotFoundError if the source is missing."""
    import torch

    digest = hashlib.sha256((SOURCES / f"{name}.cpp").read_bytes())
    # The checkout too: ninja's build file names the source by path, so two checkouts sharing one folder rebuilt
    # each other's kernels on every first load.
    digest.update(str(SOURCES).encode())
    for header in sorted(SOURCES.glob("*.h")):  # the shared headers every kernel may include
        digest.update(header.read_bytes())
    for part in (" ".join(FLAGS), torch.__version__, sys.version, " ".join(sorted(cpu_flags()))):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("0", "false", "no", "off")


def _ninja_on_path() -> None:
    """Put the ``ninja`` wheel's binary first on PATH (a venv's bin is not on PATH when its python runs directly)."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def _build(name: str) -> ModuleType:
    from torch.utils import cpp_extension

    _ninja_on_path()
    key = build_key(name)
    where = cache_dir() / f"{name}-{key}"
    where.mkdir(parents=True, exist_ok=True)
    if not any(where.glob("*.so")):
        log.warning("building the C++ CPU kernel %s for this CPU (once per machine, about 30 s) in %s", name, where)
    # torch's own guard is a file (``lock``) that a killed build leaves behind, and every later load then waits for
    # it forever. Builds here first take an flock, which the OS drops with its holder: whoever holds it is the only
    # builder alive, so a ``lock`` file it finds is stale.
    with open(where / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = where / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was interrupted", stale)
            stale.unlink()
        return cpp_extension.load(name=f"metainfer_{name}_{key}", sources=[str(SOURCES / f"{name}.cpp")],
                                  extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"], build_directory=str(where),
                                  extra_include_paths=[str(SOURCES)], verbose=False)


def load_built(name: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)`` for the built kernel ``csrc/<name>.cpp`` (building it on the first call on this machine),
    or ``(None, reason)`` when it is turned off or cannot be built; never raises. The result is kept per process."""
    if _disabled():
        return None, f"C++ CPU kernels are off ({DISABLE_ENV}=0)"
    with _lock:
        if name not in _built:
            try:
                _built[name] = (_build(name), None)
            except Exception as exc:  # noqa: BLE001 - any build failure is a refusal with its reason
                lines = [line for line in str(exc).strip().splitlines() if line.strip()][-3:]
                reason = f"C++ kernel {name} did not build ({type(exc).__name__}: {' | '.join(lines)})"
                log.warning("%s; the torch path runs instead", reason)
                _built[name] = (None, reason)
        return _built[name]


def ensure_built(name: str) -> ModuleType:
    """The built kernel module ``csrc/<name>.cpp``; raises RuntimeError with the reason where it is unavailable."""
    module, reason = load_built(name)
    if module is None:
        raise RuntimeError(reason)
    return module
