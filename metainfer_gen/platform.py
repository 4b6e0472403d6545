"""What this machine can do: device kind, compute capability, dtypes, peer access, Triton, torch.compile.

Nothing is probed at import time. :func:`capabilities` probes on first call and caches the answer for the process
(devices do not appear or vanish mid-run); :func:`refresh_capabilities` drops the cache and
:func:`override_capabilities` substitutes a made-up machine (tests, ``doctor`` previews). The Triton mode is the one
exception to the cache: it depends on ``TRITON_INTERPRET``, which tests flip at run time, so
:func:`triton_status` re-reads the environment on every call.

Sources followed: CUDA compute capabilities from ``torch.cuda.get_device_capability`` (bf16 tensor cores from sm80,
fp8 from sm89 -- NVIDIA's Ada/Hopper tables); ROCm fp8 from the MI300 (gfx94x) and MI350 (gfx95x) ISA notes; Triton's
interpreter switch is ``triton.knobs.runtime.interpret`` (env ``TRITON_INTERPRET``), read when a kernel is decorated.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib.metadata
import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from typing import Iterator

__all__ = [
    "Capabilities",
    "DeviceKind",
    "TritonMode",
    "TritonStatus",
    "capabilities",
    "native_dtype",
    "override_capabilities",
    "refresh_capabilities",
    "triton_installed",
    "triton_status",
]


class DeviceKind(enum.Enum):
    CUDA = "cuda"
    ROCM = "rocm"
    CPU = "cpu"


class TritonMode(enum.Enum):
    COMPILE = "compile"  # a GPU and triton: kernels compile to device code
    INTERPRET = "interpret"  # TRITON_INTERPRET=1: kernels run in numpy on CPU tensors, for correctness only
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class TritonStatus:
    mode: TritonMode
    version: str | None
    reason: str  # why Triton cannot compile here ("" when it can)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """A snapshot of the machine. Build one by hand to preview another machine (see :func:`override_capabilities`).

    Attributes:
        device_kind: CUDA, ROCm (torch reports HIP devices as ``cuda``) or CPU when no GPU is visible.
        device_names: one name per visible GPU; empty on a CPU-only machine.
        compute_capabilities: ``(major, minor)`` per GPU (ROCm reports the gfx major/minor); empty on CPU.
        gcn_arch: ROCm architecture names (``gfx942``), empty elsewhere.
        bf16: bf16 arithmetic runs natively (tensor cores, or AVX512-BF16/AMX on a CPU); False means emulated.
        fp8_e4m3 / fp8_e5m2: fp8 matrix arithmetic in hardware (sm89+, gfx94x+). The dtypes always exist for storage.
        peer_access: ``(src, dst)`` pairs of GPUs with direct peer-to-peer access; ``num_devices * (num_devices - 1)``
            pairs when every GPU reaches every other.
        cpu_capability: torch's vector ISA for CPU kernels (``AVX2``, ``AVX512`` ...).
        cpu_matrix: the CPU's bf16 matrix hardware, read from ``/proc/cpuinfo`` flags: ``"amx_bf16"`` (Intel AMX
            tiles, oneDNN's fastest bf16 path), ``"avx512_bf16"`` (AVX512-BF16 dot products) or ``""`` (none: bf16 is
            emulated through fp32).
        cxx_compiler: path of the C++ compiler torch.compile's CPU backend (inductor) needs, or None.
        torch_version / torch_cuda / torch_hip: the torch build.
        notes: human-readable caveats gathered while probing.
    """

    device_kind: DeviceKind
    device_names: tuple[str, ...] = ()
    compute_capabilities: tuple[tuple[int, int], ...] = ()
    gcn_arch: tuple[str, ...] = ()
    bf16: bool = False
    fp8_e4m3: bool = False
    fp8_e5m2: bool = False
    peer_access: frozenset[tuple[int, int]] = frozenset()
    cpu_capability: str = ""
    cpu_matrix: str = ""
    cxx_compiler: str | None = None
    torch_version: str = ""
    torch_cuda: str | None = None
    torch_hip: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def num_devices(self) -> int:
        return len(self.device_names)

    @property
    def has_gpu(self) -> bool:
        return self.device_kind is not DeviceKind.CPU

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """Compute capability of GPU 0 (None on CPU)."""
        return self.compute_capabilities[0] if self.compute_capabilities else None

    @property
    def all_peer_access(self) -> bool:
        """True when every GPU pair has peer access (trivially true with fewer than two GPUs)."""
        n = self.num_devices
        return len(self.peer_access) == n * (n - 1)

    def missing_peer_pairs(self) -> list[tuple[int, int]]:
        n = self.num_devices
        return [(i, j) for i in range(n) for j in range(n) if i != j and (i, j) not in self.peer_access]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from Linux's ``/proc/cpuinfo`` (``avx512f``, ``amx_bf16``, ...); empty where that file
    is missing (another OS) or unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_matrix(flags: frozenset[str]) -> str:
    return next((flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags), "")


def _probe() -> Capabilities:
    import torch

    notes: list[str] = []
    torch_hip = getattr(torch.version, "hip", None)
    kwargs: dict = dict(
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cxx_compiler=shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++"),
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        torch_hip=torch_hip,
    )
    matrix = _cpu_matrix(cpu_flags())
    kwargs["cpu_matrix"] = matrix
    if not torch.cuda.is_available():
        native = bool(matrix)
        if not native:
            notes.append("bf16 on this CPU is emulated (converted to fp32); still far faster than fp16 here")
        else:
            notes.append("bf16 is native here: a video VAE in bf16 (render --vae-dtype bfloat16) decodes about 1.5x "
                         "faster than in float32")
        notes.append("fp8 dtypes store and cast on CPU but support no arithmetic")
        return Capabilities(device_kind=DeviceKind.CPU, bf16=native, notes=tuple(notes), **kwargs)

    n = torch.cuda.device_count()
    names = tuple(torch.cuda.get_device_name(i) for i in range(n))
    ccs = tuple(tuple(torch.cuda.get_device_capability(i)) for i in range(n))
    peers = frozenset((i, j) for i in range(n) for j in range(n) if i != j and torch.cuda.can_device_access_peer(i, j))
    if torch_hip:
        archs = tuple(str(getattr(torch.cuda.get_device_properties(i), "gcnArchName", "")).split(":")[0]
                      for i in range(n))
        fp8 = all(a.startswith(("gfx94", "gfx95", "gfx12")) for a in archs)
        return Capabilities(device_kind=DeviceKind.ROCM, device_names=names, compute_capabilities=ccs, gcn_arch=archs,
                            bf16=True, fp8_e4m3=fp8, fp8_e5m2=fp8, peer_access=peers, notes=tuple(notes), **kwargs)
    bf16 = all(cc >= (8, 0) for cc in ccs)
    fp8 = all(cc >= (8, 9) for cc in ccs)
    if not bf16:
        notes.append("bf16 needs compute capability 8.0+ for tensor cores; older GPUs emulate it")
    if n > 1 and len(peers) < n * (n - 1):
        notes.append(f"{n * (n - 1) - len(peers)} of {n * (n - 1)} GPU pairs lack peer access (PCIe switch or IOMMU)")
    return Capabilities(device_kind=DeviceKind.CUDA, device_names=names, compute_capabilities=ccs, bf16=bf16,
                        fp8_e4m3=fp8, fp8_e5m2=fp8, peer_access=peers, notes=tuple(notes), **kwargs)


_override: list[Capabilities] = []


@functools.lru_cache(maxsize=1)
def _probed() -> Capabilities:
    return _probe()


def capabilities() -> Capabilities:
    """This machine's capabilities, probed on first call (imports torch; initialises CUDA if present)."""
    if _override:
        return _override[-1]
    return _probed()


def refresh_capabilities() -> None:
    """Forget the cached probe (e.g. after changing ``CUDA_VISIBLE_DEVICES`` before CUDA initialised)."""
    _probed.cache_clear()
    triton_installed.cache_clear()


@contextlib.contextmanager
def override_capabilities(caps: Capabilities) -> Iterator[Capabilities]:
    """Make :func:`capabilities` return ``caps`` inside the block (tests; previews of another machine).

    Example:
        >>> with override_capabilities(Capabilities(device_kind=DeviceKind.CPU)):
        ...     assert not capabilities().has_gpu
    """
    if not isinstance(caps, Capabilities):
        raise TypeError(f"caps must be a Capabilities; got {type(caps).__name__}")
    _override.append(caps)
    try:
        yield caps
    finally:
        _override.remove(caps)


@functools.lru_cache(maxsize=1)
def triton_installed() -> str | None:
    """Installed triton version, or None. Looks at package metadata only: triton is not imported."""
    try:
        if importlib.util.find_spec("triton") is None:
            return None
    except (ImportError, ValueError):  # a stub or None left in sys.modules
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def triton_interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_status() -> TritonStatus:
    """Whether Triton kernels compile here, only interpret (``TRITON_INTERPRET=1``), or cannot run at all."""
    version = triton_installed()
    if version is None:
        return TritonStatus(TritonMode.UNAVAILABLE, None, "triton not installed (pip install 'metainfer-gen[kernels]')")
    if triton_interpret_requested():
        return TritonStatus(TritonMode.INTERPRET, version,
                            "TRITON_INTERPRET=1: kernels are interpreted on CPU tensors (correctness only)")
    if not capabilities().has_gpu:
        return TritonStatus(TritonMode.UNAVAILABLE, version,
                            "CPU-only machine: Triton compiles for CUDA/ROCm GPUs only (TRITON_INTERPRET=1 interprets)")
    return TritonStatus(TritonMode.COMPILE, version, "")


def default_device() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"`` (the default of every loader)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device) -> "torch.dtype":  # noqa: F821  (torch is imported lazily)
    """The video pipelines' default: bfloat16 on CUDA, float32 elsewhere (a video component takes bf16 on a CPU only
    where its own quality check passes, so the pipelines ask for it per component)."""
    import torch

    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


DTYPE_ENV = "METAINFER_DEFAULT_DTYPE"  # "auto" (default), "float32" or "bfloat16": the LLM run dtype when none is given


def native_dtype(device) -> "torch.dtype":  # noqa: F821
    """The LLM engine's run dtype when none is asked for: bfloat16 wherever the hardware multiplies it natively
    (CUDA/ROCm, or a CPU with AMX-BF16 or AVX512-BF16, where oneDNN's bf16 GEMMs run 3-8x an fp32 one), float32 on a
    CPU that would emulate bf16. The environment variable ``METAINFER_DEFAULT_DTYPE`` (``float32``/``bfloat16``)
    overrides the choice for a whole process tree (the test suite pins float32 so its token checks do not depend on
    the machine).

    Raises:
        ValueError: ``METAINFER_DEFAULT_DTYPE`` set to something else.
    """
    import torch

    forced = os.environ.get(DTYPE_ENV, "auto").strip().lower() or "auto"
    if forced != "auto":
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{DTYPE_ENV}={forced!r}: use auto, float32 or bfloat16")
        return getattr(torch, forced)
    if str(device).startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if capabilities().cpu_matrix else torch.float32


def is_hub_id(source) -> bool:
    """True for a hub id as the loaders read one: not path-like (:func:`looks_like_path`) and exactly one slash
    (``org/name``); a bare name such as ``default`` is not one."""
    return not looks_like_path(source) and str(source).count("/") == 1


def looks_like_path(source) -> bool:
    """True for a path-like model source ("./x", "/x", "~/x", "C:\\x"); "org/name" (dots allowed, e.g.
    "Wan-AI/Wan2.1-T2V-1.3B") is a hub id. Loaders refuse a missing path-like source instead of asking the hub."""
    from pathlib import Path

    text = str(source)
    return text.startswith((".", "/", "~", "\\")) or Path(text).expanduser().is_absolute()
