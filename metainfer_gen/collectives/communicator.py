"""The shared-memory communicator of one same-host process group, and the algorithms that run over it.

Layout of the segment: the :class:`~metainfer_gen.collectives.shm.ShmChannel` headers, then two *parities* of
``world_size`` data slots of ``slot_bytes`` each. Consecutive rounds alternate parities, which is what lets every
round end with one wait instead of two: a rank overwrites its parity-``p`` slot in round ``n + 2`` only after it
saw each peer post round ``n + 1``, and a peer posts ``n + 1`` only after it finished reading round ``n``.

Algorithms (all in place on flat contiguous CPU tensors, chunked to the slot size):

- **one-shot** all-reduce: copy in, post, wait, each rank sums every slot. One synchronisation per chunk; reads
  ``world_size`` x the message per rank. Best for small messages.
- **two-shot** all-reduce: copy in, post, wait, rank ``r`` reduces the ``r``-th part of every slot (reduce-scatter)
  and publishes it, post, wait, each rank copies the other parts (all-gather). Two synchronisations; each rank
  reads and writes about the message size once, whatever ``world_size``.
- all-gather and reduce-scatter, one synchronisation per chunk.
- a low-precision one-shot (bf16, or int8 with one fp32 scale per block), see :mod:`.lowp`.

Sums run in rank order, with fp32 accumulation for 16-bit types when more than two ranks contribute, so every
rank gets bitwise the same result (with two ranks ``a + b`` is what gloo computes too).

Sources followed: vLLM ``custom_all_reduce.cuh`` (one-shot ``cross_device_reduce_1stage`` / two-shot
``cross_device_reduce_2stage``), SGLang's CPU ``shm_allreduce``; nano-vllm for the one-file-per-concept scale.
"""

from __future__ import annotations

import threading

import torch

from metainfer_gen.collectives import lowp
from metainfer_gen.collectives.handles import Work, Worker
from metainfer_gen.collectives.shm import CollectiveAborted, ShmChannel, ShmSegment
from metainfer_gen.collectives.topology import GroupTopology

__all__ = ["DTYPE_CODES", "OP_ALL_GATHER", "OP_ALL_REDUCE", "OP_LOWP", "OP_REDUCE_SCATTER", "ShmCommunicator",
           "shm_refusal"]

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4, torch.int32: 5,
               torch.int64: 6, torch.int8: 7, torch.uint8: 8}
OP_ALL_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_LOWP = 1, 2, 3, 4
_ORDERED_ARCHS = ("x86_64", "AMD64", "i686")
_ALIGN = 4096


def shm_refusal(topo: GroupTopology) -> str | None:
    """Why the shared-memory path cannot serve this group (None when it can)."""
    if topo.world_size < 2:
        return "group of one rank: nothing to exchange"
    if not topo.same_host:
        return f"ranks span {len(topo.ranks_per_host)} hosts; shared memory needs one"
    odd = sorted({m for m in topo.machine if m not in _ORDERED_ARCHS})
    if odd:
        return f"CPU architecture {odd[0]} is weakly ordered; the flag protocol assumes x86-64 store ordering"
    return None


class ShmCommunicator:
    """Shared buffers plus algorithms for one group whose ranks share a host. Build with :meth:`create`.

    Attributes:
        rank / world_size: within the group.
        slot_bytes: largest chunk one round moves per rank (bytes); longer messages run in several rounds.
        name: the segment name (already unlinked from ``/dev/shm`` once :meth:`create` returns).
    """

    def __init__(self, segment: ShmSegment, topo: GroupTopology, slot_bytes: int, timeout_s: float):
        self.segment, self.topo = segment, topo
        self.rank, self.world_size, self.slot_bytes = topo.rank, topo.world_size, slot_bytes
        self.name = segment.name
        self.channel = ShmChannel(segment.buffer, topo.rank, topo.world_size, list(topo.pids), timeout_s)
        data_off = _round_up(ShmChannel.header_bytes(topo.world_size), _ALIGN)
        ws = torch.frombuffer(segment.buffer, dtype=torch.uint8, offset=data_off,
                              count=2 * topo.world_size * slot_bytes)
        self._slots = ws.view(2, topo.world_size, slot_bytes)
        self._round = 0
        self.lock = threading.RLock()  # one collective at a time per process (async worker vs caller)
        self.worker = Worker(f"shm-comm-{topo.rank}")

    @staticmethod
    def segment_bytes(world_size: int, slot_bytes: int) -> int:
        """Size of the segment: headers (page-aligned) plus two parities of ``world_size`` slots."""
        return _round_up(ShmChannel.header_bytes(world_size), _ALIGN) + 2 * world_size * slot_bytes

    @classmethod
    def create(cls, group, topo: GroupTopology, slot_bytes: int, timeout_s: float, tag: str = "g"):
        """Collectively create, attach and unlink the segment of ``group`` (every member must call this).

        Returns:
            ``(communicator, None)``, or ``(None, reason)`` when any rank could not create or attach -- then all
            ranks get None, so they fall back together.
        """
        import torch.distributed as dist

        reason = shm_refusal(topo)
        if reason is not None:
            return None, reason
        nbytes = cls.segment_bytes(topo.world_size, slot_bytes)
        segment, error = None, None
        if topo.rank == 0:
            try:
                segment = ShmSegment(nbytes, tag=tag)
            except OSError as exc:
                error = f"cannot create a {nbytes} B segment in /dev/shm: {exc}"
        names: list = [None] * topo.world_size
        dist.all_gather_object(names, (segment.name if segment else None, error), group=group)
        name, error = names[0]
        if error is None and topo.rank != 0:
            try:
                segment = ShmSegment(nbytes, name=name)
            except OSError as exc:
                error = f"rank {topo.rank} cannot attach segment {name}: {exc}"
        errors: list = [None] * topo.world_size
        dist.all_gather_object(errors, error, group=group)
        if segment is not None and topo.rank == 0:
            segment.unlink()  # every rank has attached (or failed): the name is no longer needed
        failed = next((e for e in errors if e), None)
        if failed is not None:
            if segment is not None:
                segment.close()
            return None, failed
        return cls(segment, topo, slot_bytes, timeout_s), None

    # -- plumbing -------------------------------------------------------------------------------------------
    def _next_parity(self) -> int:
        parity = self._round & 1
        self._round += 1
        return parity

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._slots[parity, rank, : numel * dtype.itemsize].view(dtype)

    def _exchange(self, numel: int, dtype: torch.dtype, opcode: int) -> None:
        """Post this round and wait for the peers; check that they are in the same call."""
        code = DTYPE_CODES[dtype]
        self.channel.post(numel, code, opcode)
        self.channel.wait()
        for peer in self.channel.peers:
            theirs = self.channel.peer_header(peer)
            if theirs != (numel, code, opcode):
                raise ValueError(
                    f"collective mismatch between ranks: rank {self.rank} called op {opcode} on {numel} elements "
                    f"of code {code}, rank {peer} called op {theirs[2]} on {theirs[0]} elements of code "
                    f"{theirs[1]} (dtype codes: {_code_names()}); every rank must pass the same size and dtype")

    def _sum(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        """``out = parts[0] + parts[1] + ...`` in rank order; 16-bit types accumulate in fp32 beyond two parts."""
        if len(parts) == 2:
            torch.add(parts[0], parts[1], out=out)
            return
        if out.dtype in (torch.bfloat16, torch.float16):
            acc = parts[0].float()
            for p in parts[1:]:
                acc += p
            out.copy_(acc)
            return
        torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out += p

    def submit(self, fn, *args, result=None) -> Work:
        """Queue ``fn(*args)`` on this communicator's worker thread (in call order); ``wait()`` returns ``result``."""
        return self.worker.submit(fn, *args, result=result)

    def drain(self) -> None:
        """Wait for every queued asynchronous collective (a synchronous call must not overtake them)."""
        self.worker.drain()

    # -- algorithms -----------------------------------------------------------------------------------------
    def all_reduce_one_shot(self, x: torch.Tensor, chunk_bytes: int | None = None) -> None:
        """Sum ``x`` (flat, contiguous) over the group in place, one synchronisation per chunk."""
        n, dtype = x.numel(), x.dtype
        step = max(1, min(chunk_bytes or self.slot_bytes, self.slot_bytes) // dtype.itemsize)
        with self.lock:
            for a in range(0, n, step):
                xc = x[a: a + step]
                m = xc.numel()
                parity = self._next_parity()
                self._slot(parity, self.rank, dtype, m).copy_(xc)
                self._exchange(n, dtype, OP_ALL_REDUCE)
                parts = [xc if q == self.rank else self._slot(parity, q, dtype, m) for q in range(self.world_size)]
                self._sum(parts, xc)

    def all_reduce_two_shot(self, x: torch.Tensor, chunk_bytes: int | None = None) -> None:
        """Sum ``x`` in place as reduce-scatter then all-gather through the slots, two synchronisations per chunk."""
        n, dtype, world = x.numel(), x.dtype, self.world_size
        step = max(1, min(chunk_bytes or self.slot_bytes, self.slot_bytes) // dtype.itemsize)
        with self.lock:
            for a in range(0, n, step):
                xc = x[a: a + step]
                m = xc.numel()
                bounds = [m * q // world for q in range(world + 1)]
                lo, hi = bounds[self.rank], bounds[self.rank + 1]
                parity = self._next_parity()
                mine = self._slot(parity, self.rank, dtype, m)
                # peers read only their own parts of this slot: copy those, not the part this rank reduces
                if lo > 0:
                    mine[:lo].copy_(xc[:lo])
                if hi < m:
                    mine[hi:].copy_(xc[hi:])
                self._exchange(n, dtype, OP_ALL_REDUCE)
                if hi > lo:
                    parts = [xc[lo:hi] if q == self.rank else self._slot(parity, q, dtype, m)[lo:hi]
                             for q in range(world)]
                    self._sum(parts, mine[lo:hi])  # published for the peers' all-gather step
                    xc[lo:hi].copy_(mine[lo:hi])
                self._exchange(n, dtype, OP_ALL_REDUCE)
                for q in self.channel.peers:
                    qlo, qhi = bounds[q], bounds[q + 1]
                    if qhi > qlo:
                        xc[qlo:qhi].copy_(self._slot(parity, q, dtype, m)[qlo:qhi])

    def all_gather(self, x: torch.Tensor, out: torch.Tensor, chunk_bytes: int | None = None) -> None:
        """``out[q * n:(q + 1) * n] = x`` of rank ``q`` for every rank (``x`` flat with n elements)."""
        n, dtype = x.numel(), x.dtype
        step = max(1, min(chunk_bytes or self.slot_bytes, self.slot_bytes) // dtype.itemsize)
        with self.lock:
            for a in range(0, max(n, 1), step):
                m = min(step, n - a)
                parity = self._next_parity()
                self._slot(parity, self.rank, dtype, m).copy_(x[a: a + m])
                self._exchange(n, dtype, OP_ALL_GATHER)
                for q in range(self.world_size):
                    src = x[a: a + m] if q == self.rank else self._slot(parity, q, dtype, m)
                    out[q * n + a: q * n + a + m].copy_(src)

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor, chunk_bytes: int | None = None) -> None:
        """``out`` = the rank-th of ``world_size`` equal parts of the sum of ``x`` over the group."""
        n, dtype, world = out.numel(), x.dtype, self.world_size
        step = max(1, min(chunk_bytes or self.slot_bytes, self.slot_bytes) // (dtype.itemsize * world))
        xv = x.view(world, n)
        with self.lock:
            for a in range(0, max(n, 1), step):
                m = min(step, n - a)
                parity = self._next_parity()
                mine = self._slot(parity, self.rank, dtype, m * world).view(world, m)
                mine.copy_(xv[:, a: a + m])
                self._exchange(n, dtype, OP_REDUCE_SCATTER)
                parts = [xv[self.rank, a: a + m] if q == self.rank else
                         self._slot(parity, q, dtype, m * world).view(world, m)[self.rank]
                         for q in range(world)]
                self._sum(parts, out[a: a + m])

    def all_reduce_low_precision(self, x: torch.Tensor, scheme: str, chunk_bytes: int | None = None) -> float:
        """One-shot all-reduce exchanging ``x`` compressed with ``scheme`` ("bf16" or "int8"); sums in fp32.

        Every rank dequantises every contribution (its own too), so all ranks get the same result.

        Returns:
            this rank's relative L2 quantisation error ``||x - dequant(quant(x))|| / ||x||`` (0 for a zero input).
        """
        n = x.numel()
        budget = min(chunk_bytes or self.slot_bytes, self.slot_bytes)
        step = lowp.max_elements(scheme, budget)
        err_sq, ref_sq = 0.0, 0.0
        with self.lock:
            for a in range(0, n, step):
                xc = x[a: a + step]
                m = xc.numel()
                nbytes = lowp.packed_bytes(scheme, m)
                parity = self._next_parity()
                mine = self._slots[parity, self.rank, :nbytes]
                lowp.pack(xc, scheme, mine)
                self._exchange(n, x.dtype, OP_LOWP)
                acc = None
                for q in range(self.world_size):
                    part = lowp.unpack(self._slots[parity, q, :nbytes], scheme, m)
                    if q == self.rank:
                        err_sq += float((part - xc.float()).square().sum())
                        ref_sq += float(xc.float().square().sum())
                    acc = part if acc is None else acc.add_(part)
                xc.copy_(acc)
        return (err_sq / ref_sq) ** 0.5 if ref_sq > 0 else 0.0

    # -- teardown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker and release the mapping (the segment name is already gone)."""
        self.worker.stop()
        self.channel.release()
        self._slots = None  # type: ignore[assignment]
        self.segment.close()

    @property
    def usable(self) -> bool:
        """False once this rank or a peer aborted (timeout, dead peer); then every call raises."""
        try:
            self.channel.check_usable()
        except CollectiveAborted:
            return False
        return True

    def __repr__(self) -> str:
        return (f"ShmCommunicator(rank={self.rank}/{self.world_size}, slot={self.slot_bytes} B, "
                f"segment={self.name!r})")


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _code_names() -> str:
    return ", ".join(f"{c}={str(d).removeprefix('torch.')}" for d, c in DTYPE_CODES.items())
