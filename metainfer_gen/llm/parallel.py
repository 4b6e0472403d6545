"""Tensor-parallel placement for the engine's layers: which rank of how many, and the group to reduce over.

A :class:`TensorParallel` is handed to every layer constructor (no process-wide mutable state), so a model built
with ``TensorParallel.single()`` is the plain one-process model and never touches torch.distributed. Collectives go
through :mod:`metainfer_gen.collectives` (shared memory on one host, audited backend fallback otherwise).

Source followed: nano-vllm ``layers/linear.py`` (``tp_rank``/``tp_size`` read per layer) with the rank passed in
instead of read from ``dist.get_rank()``; Megatron-LM for the column/row split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Shard", "TensorParallel", "shard_range"]


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank: index in the group, 0 <= rank < size.
        size: number of ranks splitting each layer.
        group: the collectives group name ("tp") or handle; unused when ``size == 1``.
    Raises:
        ValueError: size < 1 or rank outside [0, size).
    """

    rank: int = 0
    size: int = 1
    group: object = "tp"

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor-parallel size must be an int >= 1; got {self.size!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank must be in [0, {self.size}); got {self.rank!r}")

    @classmethod
    def single(cls) -> "TensorParallel":
        """One process: rank 0 of 1 (layers behave exactly as plain torch layers)."""
        return cls()

    @property
    def enabled(self) -> bool:
        """True when more than one rank splits the layers."""
        return self.size > 1

    def split(self, total: int, what: str) -> int:
        """``total / size``.

        Raises:
            ValueError: ``total`` is not divisible by the size (``what`` names the dimension in the message).
        """
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}; choose a size "
                             f"that divides it")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (identity when ``size == 1``); the audit names the calling layer."""
        if self.size == 1:
            return x
        from metainfer_gen import collectives
        from metainfer_gen.collectives.dispatch import caller_site

        return collectives.all_reduce(x.contiguous(), group=self.group, site=caller_site())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """(R, n) on each rank -> (R, size * n), rank ``q``'s columns at ``[q*n:(q+1)*n]``; the audit names the
        calling layer."""
        if self.size == 1:
            return x
        from metainfer_gen import collectives
        from metainfer_gen.collectives.dispatch import caller_site

        rows, n = x.shape
        out = torch.empty(self.size, rows, n, dtype=x.dtype, device=x.device)
        collectives.all_gather(out, x.contiguous(), group=self.group, site=caller_site())
        return out.permute(1, 0, 2).reshape(rows, self.size * n)


def shard_range(total: int, tp: TensorParallel) -> tuple[int, int]:
    """``[start, end)`` of this rank's contiguous share of ``total`` rows, padding the last shards when ``total``
    does not divide (shard size ``ceil(total / size)``; ``end`` may exceed ``total``)."""
    shard = -(-total // tp.size)
    return tp.rank * shard, (tp.rank + 1) * shard


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's part of a checkpoint tensor: ``length`` entries of dimension ``dim`` from ``start``, out of
    ``total`` (the full tensor's size along ``dim``).

    Layers attach one to each split parameter (``param.tp_shard``); the loader reads exactly this range from the
    checkpoint (safetensors ``get_slice``), so no rank ever holds the full tensor. Entries past ``total`` (the
    padded tail of a vocabulary shard) are zeros.

    Raises:
        ValueError: a negative dim or start, a length below 1, or a total below 1.
    """

    dim: int
    start: int
    length: int
    total: int

    def __post_init__(self) -> None:
        if self.dim < 0 or self.start < 0 or self.length < 1 or self.total < 1:
            raise ValueError(f"shard needs dim >= 0, start >= 0, length >= 1, total >= 1; got {self}")

    @property
    def num_valid(self) -> int:
        """Entries of the shard inside the tensor (``length`` but for a padded tail)."""
        return max(min(self.start + self.length, self.total) - self.start, 0)

    @property
    def index(self) -> tuple[slice, ...]:
        """Index into the full tensor selecting the shard's entries that exist."""
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.num_valid),)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The shard of an in-memory full tensor, zero-padded to ``length`` along ``dim`` (a view when no padding).

        Raises:
            ValueError: ``full`` is not ``total`` long along ``dim``.
        """
        if full.shape[self.dim] != self.total:
            raise ValueError(f"tensor {tuple(full.shape)} is not {self.total} long along dimension {self.dim}")
        part = full[self.index]
        if self.num_valid == self.length:
            return part
        pad = list(full.shape)
        pad[self.dim] = self.length - self.num_valid
        return torch.cat([part, full.new_zeros(pad)], dim=self.dim)
