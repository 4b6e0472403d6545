"""Where the ranks of a group live: which share a host (and so shared memory), and how GPUs on a host are linked.

:func:`host_key` identifies a host by hostname plus kernel boot id (two containers on different machines may share
a hostname; they never share a boot id). :func:`gather_topology` exchanges it over the group's backend, so it is a
collective call. On GPU machines :func:`gpu_links` reports NVLink / PCIe / no-peer-access per device pair from NVML
when ``pynvml`` is installed and otherwise from ``torch.cuda.can_device_access_peer``; neither is required, and a
missing answer is reported as ``"unknown"``, never raised.

Source followed: vLLM's ``custom_all_reduce`` topology checks (``_is_full_nvlink`` through NVML, then a peer-access
test) -- with the difference that a failed check falls back with a reason instead of disabling silently.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass

__all__ = ["GroupTopology", "LinkKind", "gather_topology", "gpu_links", "host_key"]


class LinkKind:
    """Link between two GPUs on one host (string constants, as NVML reports them in words)."""

    NVLINK = "nvlink"
    PCIE = "pcie"  # peer access over the PCIe fabric
    NO_PEER = "no_peer_access"
    UNKNOWN = "unknown"


def host_key() -> str:
    """``"hostname/boot-id"``: equal for two processes exactly when they run on the same kernel instance."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True, slots=True)
class GroupTopology:
    """The ranks of one process group, as seen from ``rank``.

    Attributes:
        rank / world_size: position within the group and its size.
        hosts: host key per group rank.
        pids: process id per group rank (meaningful between ranks on one host).
        machine: ``platform.machine()`` per rank (``x86_64``): the shared-memory path needs ordered stores.
    """

    rank: int
    world_size: int
    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    machine: tuple[str, ...]

    @property
    def same_host(self) -> bool:
        """True when every rank of the group runs on this host."""
        return len(set(self.hosts)) == 1

    @property
    def ranks_per_host(self) -> dict[str, list[int]]:
        """host key -> group ranks on it, in rank order."""
        out: dict[str, list[int]] = {}
        for r, h in enumerate(self.hosts):
            out.setdefault(h, []).append(r)
        return out


def gather_topology(group=None) -> GroupTopology:
    """Exchange host key, pid and architecture across ``group`` (a collective: every member must call it).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call collectives.init_distributed() first")
    mine = (host_key(), os.getpid(), platform.machine())
    world = dist.get_world_size(group)
    out: list = [None] * world
    dist.all_gather_object(out, mine, group=group)
    return GroupTopology(rank=dist.get_rank(group), world_size=world, hosts=tuple(o[0] for o in out),
                         pids=tuple(o[1] for o in out), machine=tuple(o[2] for o in out))


def gpu_links(devices: list[int] | None = None) -> dict[tuple[int, int], str]:
    """Link kind for each ordered pair of local GPUs, ``{}`` on a machine without CUDA.

    Args:
        devices: CUDA device indices to inspect; None means all visible ones.
    Returns:
        ``{(i, j): LinkKind.*}`` for i != j. NVML (``pynvml``) distinguishes NVLink from PCIe; without it, pairs with
        peer access are reported as PCIe (the conservative choice: no NVLink tuning is applied) and the others as
        ``no_peer_access``.
    """
    import torch

    if not torch.cuda.is_available():
        return {}
    devices = list(range(torch.cuda.device_count())) if devices is None else list(devices)
    nvlink = _nvml_nvlink_pairs(devices)
    links = {}
    for i in devices:
        for j in devices:
            if i == j:
                continue
            try:
                peer = torch.cuda.can_device_access_peer(i, j)
            except RuntimeError:
                links[(i, j)] = LinkKind.UNKNOWN
                continue
            if not peer:
                links[(i, j)] = LinkKind.NO_PEER
            else:
                links[(i, j)] = LinkKind.NVLINK if (i, j) in nvlink else LinkKind.PCIE
    return links


def _nvml_nvlink_pairs(devices: list[int]) -> set[tuple[int, int]]:
    """Pairs NVML reports as NVLink-connected; empty when pynvml is missing or NVML fails."""
    try:
        import pynvml  # optional
    except ImportError:
        return set()
    pairs: set[tuple[int, int]] = set()
    try:
        pynvml.nvmlInit()
        try:
            # CUDA_VISIBLE_DEVICES renumbers devices; NVML does not. Map through the visible list when set.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            phys = [int(v) for v in visible.split(",")] if visible and visible.replace(",", "").isdigit() else None
            handles = {d: pynvml.nvmlDeviceGetHandleByIndex(phys[d] if phys else d) for d in devices}
            for i in devices:
                for j in devices:
                    if i != j and pynvml.nvmlDeviceGetP2PStatus(
                            handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK:
                        pairs.add((i, j))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing on the driver, or too old for P2P status: not an error, just no answer
        return set()
    return pairs
