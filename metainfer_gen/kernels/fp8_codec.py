"""Software e4m3fn decode and encode for Triton kernels on GPUs without fp8 conversions (sm_80, sm_86).

Triton 3.9 refuses ``fp8e4nv`` (torch's ``float8_e4m3fn``) below sm_89: "type fp8e4nv not supported in this
architecture". There the fp8 kernels take a ``uint8`` view of the fp8 tensors (:func:`fp8_bits`) and convert with
integer arithmetic, selected by a ``SOFT_FP8`` constexpr that the wrappers set from :func:`software_fp8`.

e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, ``0x7F``/``0xFF`` NaN, largest finite
value 448, smallest subnormal 2**-9 (OCP 8-bit floating point specification, "E4M3").

- Decode: ``sign << 15 | (bits & 0x7F) << 7`` is an fp16 whose value is the e4m3 value times 2**-8, for normals and
  subnormals alike (the e4m3 subnormals land on fp16 subnormals); one fp16 multiply by 256 is exact (the largest
  result is 448), and the NaN codes become fp16 NaN. Every e4m3 value is exact in fp16, so a fp16 ``tl.dot`` with
  fp32 accumulation forms the same products as the fp8 MMA on sm_89+.
- Encode: round to nearest, ties to even, saturating to +-448 (PTX ``cvt.rn.satfinite.e4m3x2.f32``, i.e. torch's
  ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``); NaN stays NaN (0x7F with the input's sign, as torch's cast);
  the sign of zero is kept. Normals drop 20 of the 23 fp32 mantissa bits with the usual round-half-even integer
  add; below 2**-6 the value is a multiple of 2**-9, rounded by adding 2**23 to ``a * 512`` in fp32.

Not used: Triton's ``fp8e4b15`` (bias 15: the same bits times 2**-8, decodable on sm_80) has no NaN codes, is
deprecated from Hopper on, and its fp32 -> fp8 rounding is the backend's; ``tl.inline_asm_elementwise`` with
``cvt.*.e4m3x2`` needs sm_89 PTX.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from metainfer_gen.kernels.common import lazy_triton_kernel
from metainfer_gen.kernels.launch import target_arch

__all__ = ["HARDWARE_FP8_ARCH", "codec", "fp8_bits", "lazy_fp8_kernel", "software_fp8"]

# The first NVIDIA architecture with e4m3 conversions (cvt.*.e4m3x2) and fp8 MMA.
HARDWARE_FP8_ARCH = 89


def software_fp8(device: torch.device | str, forced: bool | None = None) -> bool:
    """Whether kernels for ``device`` must convert e4m3 in software: ``forced`` when given (tests), else True when
    the target architecture (the one :func:`~metainfer_gen.kernels.launch.record_launches` records for, else the
    CUDA device's capability) is below sm_89. CPU tensors (the interpreter) use the fp8 dtype directly."""
    if forced is not None:
        return bool(forced)
    arch = target_arch(device)
    return arch is not None and arch < HARDWARE_FP8_ARCH


def fp8_bits(tensor: torch.Tensor, software: bool) -> torch.Tensor:
    """``tensor`` (float8_e4m3fn) as its uint8 bytes when ``software``, else unchanged (same storage, no copy)."""
    if software and tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8)
    return tensor


# Bound on the first build (triton is imported lazily); the helpers look names up in module globals.
tl = triton = None


@lazy_triton_kernel
def codec():
    """The ``@triton.jit`` helpers ``(e4m3_to_fp16, fp32_to_e4m3)``: uint8 codes -> fp16 values, and fp32 values ->
    uint8 codes (shapes kept). Kernels built with :func:`lazy_fp8_kernel` find them as module globals."""
    global tl, triton
    import triton
    import triton.language as tl

    @triton.jit
    def e4m3_to_fp16(bits):
        b = bits.to(tl.int32)
        mag = b & 0x7F
        sign = (b & 0x80) << 8
        half = tl.where(mag == 0x7F, sign | 0x7E00, sign | (mag << 7))  # 0x7E00: fp16 quiet NaN
        return half.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0

    @triton.jit
    def fp32_to_e4m3(x):
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = tl.minimum(tl.abs(x), 448.0)  # saturate; NaN is handled below whatever minimum returns
        ab = a.to(tl.int32, bitcast=True)
        # Normals: round half to even at bit 20, then rebias the exponent from 127 to 7 (120 << 3 = 960).
        normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - 960
        # Subnormals (a < 2**-6): a * 512 in [0, 8]; adding 2**23 rounds it half-even to an integer in the low bits.
        sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
        code = tl.where(a < 0.015625, sub, normal)
        code = tl.where(x != x, 0x7F, code)
        return (code | sign).to(tl.uint8)

    return e4m3_to_fp16, fp32_to_e4m3


def lazy_fp8_kernel(builder: Callable[[], Any]) -> Callable[[], Any]:
    """:func:`~metainfer_gen.kernels.common.lazy_triton_kernel` for kernels that call the codec: every call also
    binds ``e4m3_to_fp16`` and ``fp32_to_e4m3`` in the builder's module globals for the current ``TRITON_INTERPRET``
    setting. An interpreted kernel looks them up each time it runs, and would fail on the compiled helpers that a
    compiled build in the same process (an AOT test) bound last."""
    get = lazy_triton_kernel(builder)
    namespace = builder.__globals__

    @functools.wraps(builder)
    def bound() -> Any:
        namespace["e4m3_to_fp16"], namespace["fp32_to_e4m3"] = codec()
        return get()

    return bound
