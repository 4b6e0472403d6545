"""Ahead-of-time Triton compiles for GPU architectures this machine does not have, and what they imply.

:func:`compile_launch` compiles one recorded :class:`~metainfer_gen.kernels.launch.KernelLaunch` for ``sm_<arch>``
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` (no GPU needed), reads registers and
spills from ``ptxas -v`` on the PTX (Triton ships ``ptxas`` in ``triton/backends/nvidia/bin``), shared memory from
the compile metadata, and the warps per SM that registers and shared memory allow (:func:`occupancy`).

Per-SM limits (CUDA C Programming Guide, "Technical Specifications per Compute Capability"): 65536 32-bit
registers, at most 255 per thread, allocated per warp in units of 256; 164 KB shared memory on sm_80, 100 KB on
sm_86, sm_89 and sm_120, 228 KB on sm_90, 1 KB of it reserved per block; 64 resident warps on sm_80/sm_90, 48 on
sm_86/sm_89/sm_120; 32 resident blocks (24 on sm_89, 16 on sm_86).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from metainfer_gen.kernels.launch import KernelLaunch

__all__ = ["ARCH_LIMITS", "AotResult", "ArchLimits", "compile_launch", "occupancy", "ptxas_usage", "signature_of"]


@dataclass(frozen=True, slots=True)
class ArchLimits:
    """Per-SM resources of one compute capability."""

    regs_per_sm: int
    smem_per_sm: int  # bytes
    max_warps: int
    max_blocks: int
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256  # registers, per warp
    smem_reserved_per_block: int = 1024


ARCH_LIMITS: dict[int, ArchLimits] = {
    80: ArchLimits(65536, 164 * 1024, 64, 32),
    86: ArchLimits(65536, 100 * 1024, 48, 16),
    89: ArchLimits(65536, 100 * 1024, 48, 24),
    90: ArchLimits(65536, 228 * 1024, 64, 32),
    120: ArchLimits(65536, 100 * 1024, 48, 32),
}

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
           torch.float8_e5m2: "fp8e5", torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "i1"}
_META_OPTIONS = ("num_warps", "num_stages", "num_ctas")


@dataclass(frozen=True, slots=True)
class AotResult:
    """One kernel compiled for one arch; ``error`` is set (and the numbers are None) when the compile failed."""

    kernel: str
    arch: int
    num_warps: int
    error: str | None = None
    registers: int | None = None
    spill_stores: int | None = None  # bytes
    spill_loads: int | None = None
    shared: int | None = None  # bytes per block
    warps_per_sm: int | None = None
    ptx: str = ""
    ttgir: str = ""

    @property
    def spilled(self) -> int | None:
        return None if self.spill_stores is None else self.spill_stores + self.spill_loads


def signature_of(launch: KernelLaunch) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton's ``signature`` and ``constexprs`` for a recorded launch (tensors by dtype, ints by range)."""
    names = launch.kernel.arg_names
    constexprs = {k: v for k, v in launch.meta.items() if k not in _META_OPTIONS}
    signature: dict[str, str] = {}
    values = dict(zip(names, launch.args))
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name not in values:
            raise ValueError(f"{launch.name}: no value for argument {name!r}")
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: argument {name!r} of type {type(value).__name__} has no Triton type")
    return signature, constexprs


def _ptxas() -> list[str]:
    import triton

    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return [os.path.join(folder, name) for name in ("ptxas", "ptxas-blackwell")
            if os.path.exists(os.path.join(folder, name))]


def ptxas_usage(ptx: str) -> tuple[int, int, int]:
    """(registers per thread, spill store bytes, spill load bytes) from ``ptxas -v`` on ``ptx``.

    Raises:
        RuntimeError: no ptxas accepted the PTX (the message carries the last one's output).
    """
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).rstrip(",")
    output = ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for ptxas in _ptxas():
            proc = subprocess.run([ptxas, "-v", "--gpu-name", target, path, "-o", os.path.join(tmp, "k.cubin")],
                                  capture_output=True, text=True)
            output = proc.stdout + proc.stderr
            regs = re.search(r"Used (\d+) registers", output)
            if proc.returncode == 0 and regs:
                spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", output)
                stores, loads = (int(spills.group(1)), int(spills.group(2))) if spills else (0, 0)
                return int(regs.group(1)), stores, loads
    raise RuntimeError(f"ptxas -v failed for {target}: {output.strip()[-400:]}")


def occupancy(arch: int, registers: int, shared: int, num_warps: int) -> int:
    """Resident warps per SM that ``registers`` per thread and ``shared`` bytes per block allow on sm_``arch``."""
    lim = ARCH_LIMITS[arch]
    unit = lim.reg_alloc_unit
    regs_per_warp = -(-max(registers, 1) * 32 // unit) * unit
    blocks = min(lim.max_blocks, lim.max_warps // num_warps, lim.regs_per_sm // (regs_per_warp * num_warps))
    if shared:
        blocks = min(blocks, lim.smem_per_sm // (shared + lim.smem_reserved_per_block))
    return blocks * num_warps


def _reason(exc: Exception) -> str:
    """The line of a compiler error that says why (Triton's CompilationError puts the cause last, after the source)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip() and line.strip() != "^"]
    reason = lines[-1] if lines else type(exc).__name__
    return f"{type(exc).__name__}: {reason}"[:150]


def compile_launch(launch: KernelLaunch, arch: int) -> AotResult:
    """Compile ``launch`` for sm_``arch`` and read its resource use; a compiler error is returned, not raised."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    num_warps = int(launch.meta.get("num_warps", 4))
    options = {k: launch.meta[k] for k in _META_OPTIONS if k in launch.meta}
    try:
        signature, constexprs = signature_of(launch)
        compiled = triton.compile(ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        ptx = compiled.asm["ptx"]
        registers, stores, loads = ptxas_usage(ptx)
    except Exception as exc:  # the table reports the compiler's message
        return AotResult(launch.name, arch, num_warps, error=_reason(exc))
    shared = int(compiled.metadata.shared)
    return AotResult(launch.name, arch, num_warps, None, registers, stores, loads, shared,
                     occupancy(arch, registers, shared, num_warps), ptx, compiled.asm.get("ttgir", ""))
