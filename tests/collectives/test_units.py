"""Single-process pieces: topology refusals, group layout, compression formats, segments, the waiting protocol."""

from __future__ import annotations

import os
import time

import pytest
import torch

from metainfer_gen.collectives import lowp
from metainfer_gen.collectives.communicator import shm_refusal
from metainfer_gen.collectives.distributed import _layout
from metainfer_gen.collectives.shm import (SHM_DIR, CollectiveAborted, CollectiveTimeout, ShmChannel, ShmSegment,
                                           list_segments)
from metainfer_gen.collectives.topology import GroupTopology, gpu_links, host_key


def _topo(hosts, machine="x86_64"):
    n = len(hosts)
    return GroupTopology(rank=0, world_size=n, hosts=tuple(hosts), pids=tuple(range(1, n + 1)),
                         machine=(machine,) * n)


def test_shm_refusal_reasons():
    assert shm_refusal(_topo(["a", "a"])) is None
    assert "2 hosts" in shm_refusal(_topo(["a", "b", "a"]))
    assert _topo(["a", "b", "a"]).ranks_per_host == {"a": [0, 2], "b": [1]}
    assert "one rank" in shm_refusal(_topo(["a"]))
    assert "weakly ordered" in shm_refusal(_topo(["a", "a"], machine="aarch64"))
    assert host_key().count("/") >= 1
    if not torch.cuda.is_available():
        assert gpu_links() == {}


def test_group_layout_tp_fastest():
    groups = _layout(8, tp=2, cfg=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cfg"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for kind in groups.values():  # every rank in exactly one group of each kind
        assert sorted(r for g in kind for r in g) == list(range(8))


def test_group_layout_context_parallel_inside_cfg():
    groups = _layout(8, tp=1, cfg=2, cp=2)  # 2 DP x 2 CFG x 2 CP: a CP pair per branch, CP ranks adjacent
    assert groups["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cfg"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp"] == [[r] for r in range(8)]


@pytest.mark.parametrize("scheme, bound", [("bf16", 2 ** -8), ("int8", 0.01)])
@pytest.mark.parametrize("n", [1, 255, 256, 1001])
def test_low_precision_round_trip(scheme, bound, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    buf = torch.empty(lowp.packed_bytes(scheme, n), dtype=torch.uint8)
    lowp.pack(x, scheme, buf)
    y = lowp.unpack(buf, scheme, n)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert float((y - x).norm() / x.norm()) < bound
    assert lowp.packed_bytes(scheme, lowp.max_elements(scheme, 1 << 16)) <= 1 << 16
    with pytest.raises(ValueError, match="low-precision scheme"):
        lowp.packed_bytes("fp4", n)


def test_segment_attach_then_unlink_keeps_mapping():
    seg = ShmSegment(4096, tag="unit")
    try:
        other = ShmSegment(4096, name=seg.name)
        seg.unlink()
        assert seg.name not in list_segments() and not os.path.exists(os.path.join(SHM_DIR, seg.name))
        seg.buffer[:4] = b"abcd"
        assert other.buffer[:4] == b"abcd"  # both mappings still share the memory after unlink
        other.close()
        with pytest.raises(FileNotFoundError):
            ShmSegment(4096, name=seg.name)
    finally:
        seg.close()


def test_wait_times_out_and_posts_abort():
    seg = ShmSegment(ShmChannel.header_bytes(2), tag="unit")
    seg.unlink()
    try:
        me = ShmChannel(seg.buffer, 0, 2, [os.getpid(), os.getpid()], timeout_s=0.3)
        peer = ShmChannel(seg.buffer, 1, 2, [os.getpid(), os.getpid()], timeout_s=0.3)
        me.post(10, 1, 1)
        peer.post(10, 1, 1)
        me.wait()  # both posted: returns at once
        assert me.peer_header(1) == (10, 1, 1)
        me.post(10, 1, 1)
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="did not reach collective #2 within 0.3 s"):
            me.wait()
        assert 0.25 < time.monotonic() - start < 2.0
        with pytest.raises(CollectiveAborted, match="rank 0 aborted"):
            peer.post(10, 1, 1)  # the peer learns of the abort on its next call instead of waiting
        me.release()
        peer.release()
    finally:
        seg.close()
