"""Compressed exchange formats for the optional low-precision all-reduce (off by default).

- ``"bf16"``: the message rounded to bfloat16 (2 bytes per element; relative error per element <= 2**-9).
- ``"int8"``: symmetric int8 with one fp32 scale per block of :data:`INT8_BLOCK` elements (``scale = amax / 127``;
  1 + 4/BLOCK bytes per element; error per element <= scale / 2).

A packed buffer is a flat ``uint8`` tensor: the values, then (int8 only) the scales at the next 4-byte boundary.
Sums are always formed in fp32 after unpacking. Source followed: the block-scaled int8/fp8 communication
compression of SGLang's and DeepSpeed's quantised collectives (ZeRO++ qgZ), without the hierarchical part.
"""

from __future__ import annotations

import torch

__all__ = ["INT8_BLOCK", "SCHEMES", "max_elements", "pack", "packed_bytes", "unpack"]

SCHEMES = ("bf16", "int8")
INT8_BLOCK = 256


def _check(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"low-precision scheme must be one of {SCHEMES}; got {scheme!r}")


def packed_bytes(scheme: str, numel: int) -> int:
    """Bytes the packed form of ``numel`` elements takes."""
    _check(scheme)
    if scheme == "bf16":
        return 2 * numel
    blocks = -(-numel // INT8_BLOCK)
    return _scale_offset(numel) + 4 * blocks


def _scale_offset(numel: int) -> int:
    return (numel + 3) // 4 * 4


def max_elements(scheme: str, nbytes: int) -> int:
    """Most elements whose packed form fits ``nbytes`` (a whole number of int8 blocks)."""
    _check(scheme)
    if scheme == "bf16":
        return max(1, nbytes // 2)
    per_block = INT8_BLOCK + 4
    return max(INT8_BLOCK, (nbytes // per_block) * INT8_BLOCK)


def pack(x: torch.Tensor, scheme: str, out: torch.Tensor) -> None:
    """Write the packed form of flat ``x`` (float32/bfloat16/float16) into ``out`` (uint8, ``packed_bytes``)."""
    n = x.numel()
    if scheme == "bf16":
        out[: 2 * n].view(torch.bfloat16).copy_(x)
        return
    blocks = -(-n // INT8_BLOCK)
    xf = x.float()
    if n % INT8_BLOCK:
        xf = torch.nn.functional.pad(xf, (0, blocks * INT8_BLOCK - n))
    xb = xf.view(blocks, INT8_BLOCK)
    scale = xb.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(xb / scale[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    out[:n].view(torch.int8).copy_(q)
    off = _scale_offset(n)
    out[off: off + 4 * blocks].view(torch.float32).copy_(scale)


def unpack(buf: torch.Tensor, scheme: str, numel: int) -> torch.Tensor:
    """The fp32 values of a packed buffer (a new tensor of ``numel`` elements)."""
    if scheme == "bf16":
        return buf[: 2 * numel].view(torch.bfloat16).float()
    blocks = -(-numel // INT8_BLOCK)
    off = _scale_offset(numel)
    scale = buf[off: off + 4 * blocks].view(torch.float32)
    q = buf[:numel].view(torch.int8).float()
    full = blocks * INT8_BLOCK
    if full != numel:
        q = torch.nn.functional.pad(q, (0, full - numel))
    return (q.view(blocks, INT8_BLOCK) * scale[:, None]).view(-1)[:numel]
