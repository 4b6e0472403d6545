"""Rank bodies for the collectives tests (run by :func:`tests.collectives.harness.run_ranks`, one per process).

Each returns a small picklable payload that the test asserts on; comparisons against gloo run inside the ranks
(``torch.equal`` with gloo's result on the same inputs), so only booleans and numbers travel back.
"""

from __future__ import annotations

import os
import signal
import time

import torch

# sizes in elements: 1 to 64 MB of float32, mostly small and odd; the big ones once each
SMALL_SIZES = [1, 2, 3, 7, 127, 1000, 4097, 65537, 262143]
BIG_SIZES = [(1 << 20) + 3]  # crosses several chunks
HUGE = 16 << 20  # 64 MB of float32


def _init(**kwargs):
    from metainfer_gen import collectives

    return collectives, collectives.init_distributed(**kwargs)


def _data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n + salt)
    return torch.randn(n, generator=g).to(dtype)


def equal_to_gloo(rank: int, world: int, args: dict) -> list:
    """All-reduce (auto, one-shot, two-shot), all-gather and reduce-scatter vs gloo; returns the mismatches."""
    import torch.distributed as dist

    C, _ = _init(slot_bytes=1 << 20)
    bad = []
    cases = [(n, dt) for dt in (torch.float32, torch.bfloat16) for n in SMALL_SIZES + BIG_SIZES]
    cases.append((HUGE, torch.float32))
    for n, dt in cases:
        x = _data(rank, n, dt)
        ref = x.clone()
        dist.all_reduce(ref)
        for algo in (None, "one_shot", "two_shot") if n != HUGE else (None,):
            y = x.clone()
            out = C.all_reduce(y, algorithm=algo)
            if out is not y or not torch.equal(y, ref):
                bad.append(("all_reduce", algo, n, str(dt)))
        m = n if n != HUGE else n // 2  # all-gather output and reduce-scatter input: 64 MB at most
        part = x[:m].contiguous()
        gathered, gref = torch.empty(world * m, dtype=dt), torch.empty(world * m, dtype=dt)
        C.all_gather(gathered, part)
        dist.all_gather(list(gref.chunk(world)), part)
        if not torch.equal(gathered, gref):
            bad.append(("all_gather", None, m, str(dt)))
        full = _data(rank, world * m, dt, salt=7)
        rs = torch.empty(m, dtype=dt)
        C.reduce_scatter(rs, full)
        rref = full.clone()
        dist.all_reduce(rref)
        if not torch.equal(rs, rref[rank * m: (rank + 1) * m]):
            bad.append(("reduce_scatter", None, m, str(dt)))
    shaped = _data(rank, 6 * 5, torch.float32).view(6, 5)  # any shape, not only flat
    ref = shaped.clone()
    dist.all_reduce(ref)
    if not torch.equal(C.all_reduce(shaped), ref):
        bad.append(("all_reduce", "2-d", 30, "float32"))
    C.shutdown_distributed()
    return bad


def audit_and_errors(rank: int, world: int, args: dict) -> dict:
    """The audit records each path (and refusals); bad arguments raise clear errors; a mismatch raises on both."""
    import dataclasses

    from metainfer_gen import kernels
    from metainfer_gen.kernels.registry import FastPathRefused

    C, state = _init()
    out: dict = {}
    with kernels.audit() as report:
        C.all_reduce(torch.ones(16))
        C.all_reduce(torch.ones(1 << 20))  # 4 MB > the default 256 KB one-shot threshold
        C.all_reduce(torch.ones(8, dtype=torch.bool))  # no shared-memory kernel for bool: gloo, with the reason
        remote = dataclasses.replace(state.groups["world"], comm=None, comm_refusal="ranks span 2 hosts")
        C.all_reduce(torch.ones(4), group=remote)
        x = torch.ones(10)
        C.all_gather(torch.empty(10 * world), x)
        C.reduce_scatter(torch.empty(5), x)
    out["paths"] = report.paths()
    out["refusals"] = {k: sorted(v) for k, v in report.refusals().items()}
    rec = C.last_audit()
    out["last"] = (rec.op, rec.path, rec.reason)
    C.all_reduce(torch.ones(1 << 20))
    out["last_reason"] = C.last_audit().reason
    try:
        C.all_reduce(torch.ones(8, dtype=torch.bool), strict=True)
        out["strict"] = None
    except FastPathRefused as exc:
        out["strict"] = str(exc)
    errors = {}
    bad_calls = {
        "dtype": lambda: C.all_reduce(torch.ones(4, dtype=torch.complex64)),
        "non_contiguous": lambda: C.all_reduce(torch.ones(4, 4).t()),
        "not_tensor": lambda: C.all_reduce([1.0, 2.0]),
        "gather_size": lambda: C.all_gather(torch.empty(7), torch.ones(4)),
        "gather_dtype": lambda: C.all_gather(torch.empty(8, dtype=torch.bfloat16), torch.ones(4)),
        "scatter_divisible": lambda: C.reduce_scatter(torch.empty(2), torch.ones(5)),
        "lowp_int": lambda: C.all_reduce(torch.ones(4, dtype=torch.int32), low_precision="int8"),
        "algorithm": lambda: C.all_reduce(torch.ones(4), algorithm="ring"),
        "group": lambda: C.all_reduce(torch.ones(4), group="pp"),
    }
    for name, call in bad_calls.items():
        try:
            call()
            errors[name] = None
        except (TypeError, ValueError) as exc:
            errors[name] = (type(exc).__name__, str(exc))
    out["errors"] = errors
    # ranks passing different sizes: both raise, and the communicator stays usable afterwards
    try:
        C.all_reduce(torch.ones(100 + rank))
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    y = torch.full((33,), float(rank + 1))
    C.all_reduce(y)
    out["after_mismatch"] = y.tolist() == [float(sum(range(1, world + 1)))] * 33
    C.shutdown_distributed()
    return out


def async_and_low_precision(rank: int, world: int, args: dict) -> dict:
    """Async handles overlap compute and keep call order; low-precision error is reported and bounded."""
    import torch.distributed as dist

    C, _ = _init()
    out: dict = {}
    xs = [_data(rank, n, torch.float32, salt=s) for s, n in enumerate((1000, 300_000, 5))]
    refs = [x.clone() for x in xs]
    for r in refs:
        dist.all_reduce(r)
    works = [C.all_reduce(x, async_op=True) for x in xs]
    a = torch.randn(256, 256)
    _ = a @ a  # compute while the exchanges run on the worker thread
    sync = _data(rank, 77, torch.float32, salt=9)  # a synchronous call after queued async ones
    sref = sync.clone()
    dist.all_reduce(sref)
    C.all_reduce(sync)
    out["async_equal"] = [torch.equal(w.wait(timeout=60), r) for w, r in zip(works, refs)]
    out["async_returns_input"] = all(w.wait() is x for w, x in zip(works, xs))
    out["sync_after_async"] = torch.equal(sync, sref)
    g_out, g_in = torch.empty(world * 10), torch.full((10,), float(rank))
    w = C.all_gather(g_out, g_in, async_op=True)
    out["async_gather"] = w.wait(60).tolist() == [float(q) for q in range(world) for _ in range(10)]
    for scheme in ("bf16", "int8"):
        x = _data(rank, 100_003, torch.float32, salt=3)
        exact = x.clone()
        dist.all_reduce(exact)
        C.all_reduce(x, low_precision=scheme)
        rec = C.last_audit()
        gathered = torch.empty(world * x.numel())
        dist.all_gather(list(gathered.chunk(world)), x)
        out[scheme] = {
            "path": rec.path,
            "reported": rec.low_precision_error,
            "actual": float((x - exact).norm() / exact.norm()),
            "same_on_all_ranks": all(torch.equal(c, x) for c in gathered.chunk(world)),
        }
    C.shutdown_distributed()
    return out


def killed_rank(rank: int, world: int, args: dict) -> dict:
    """Rank 1 SIGKILLs itself mid-run; rank 0 must raise CollectiveTimeout well within the timeout, then shut down."""
    from metainfer_gen.collectives.shm import CollectiveTimeout, list_segments

    C, state = _init(timeout_s=args["peer_timeout_s"])
    out = {"segments_while_running": list_segments(), "job_segment": state.groups["world"].comm.name}
    x = torch.ones(1000)
    last_ok = time.monotonic()
    for i in range(1_000_000):
        if rank == 1 and i == 50:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            C.all_reduce(x, algorithm="one_shot" if i % 2 else "two_shot")
        except CollectiveTimeout as exc:
            out["raised_after_s"] = time.monotonic() - last_ok
            out["error"] = str(exc)
            out["calls"] = i
            break
        x.fill_(1.0)
        last_ok = time.monotonic()
    try:
        C.all_reduce(x)
        out["second_call"] = None
    except CollectiveTimeout as exc:
        out["second_call"] = type(exc).__name__
    start = time.monotonic()
    C.shutdown_distributed()
    out["shutdown_s"] = time.monotonic() - start
    return out


def silent_peer(rank: int, world: int, args: dict) -> dict:
    """Rank 1 is alive but never joins; rank 0 times out; rank 1's late call then sees the abort."""
    from metainfer_gen.collectives.shm import CollectiveAborted, CollectiveTimeout

    C, _ = _init(timeout_s=args["peer_timeout_s"])
    out: dict = {}
    start = time.monotonic()
    try:
        if rank == 0:
            C.all_reduce(torch.ones(10))
        else:
            time.sleep(args["peer_timeout_s"] + 1.0)
            C.all_reduce(torch.ones(10))
        out["raised"] = None
    except CollectiveTimeout as exc:
        out["raised"] = type(exc).__name__
        out["after_s"] = time.monotonic() - start
        out["message"] = str(exc)
    out["is_aborted_type"] = out["raised"] == CollectiveAborted.__name__
    C.shutdown_distributed()
    return out


def thresholds_cache(rank: int, world: int, args: dict) -> dict:
    """A short measurement picks valid thresholds; written once, the next load reads the cache."""
    from metainfer_gen.collectives import tuning

    C, state = _init()
    world_group = state.groups["world"]
    measured = tuning.measure(world_group.comm, sizes=[4096, 65536], chunks=[65536])
    if rank == 0:
        tuning.write_cache(tuning.machine_key(world), measured)
    loaded = tuning.load_or_measure(world_group.comm, world_group.group)
    C.shutdown_distributed()
    return {"measured": (measured.source, measured.one_shot_max_bytes, measured.chunk_bytes,
                         sorted(measured.timings_us)),
            "loaded": (loaded.source, loaded.one_shot_max_bytes, loaded.chunk_bytes),
            "default_source": world_group.thresholds.source}
