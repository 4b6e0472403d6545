"""Run a worker function on N local ranks (spawned processes, gloo), with a hard deadline on the whole run.

Workers live in :mod:`tests.collectives.workers` (or any module, named ``"package.module:function"``) and have the
signature ``fn(rank, world, args) -> payload``; the
harness sets torchrun's environment variables, one intra-op thread, a private thresholds cache with tuning off, and
collects ``{rank: payload}``. A worker that raises reports its traceback; a run past ``timeout_s`` is killed and
fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback

import torch.multiprocessing as mp


def _entry(fn_name: str, rank: int, world: int, port: int, cache: str, args: dict, out) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1", METAINFER_COLLECTIVES_TUNE="0",
                      METAINFER_COLLECTIVES_CACHE=cache)
    import torch

    torch.set_num_threads(1)
    import importlib

    module, _, name = fn_name.rpartition(":")
    try:
        fn = getattr(importlib.import_module(module or "tests.collectives.workers"), name)
        out.put((rank, "ok", fn(rank, world, args)))
    except BaseException:  # reported to the parent, which fails the test with it
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(fn_name: str, tmp_path, world: int = 2, timeout_s: float = 180.0, **args) -> dict:
    """Run ``workers.<fn_name>`` (or ``"module:function"``) on ``world`` ranks; return ``{rank: payload}``.

    Raises:
        AssertionError: a rank raised, or the run exceeded ``timeout_s`` (survivors are killed first).
    """
    from metainfer_gen.collectives.distributed import free_port

    expected = args.pop("expect_reports", world)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    cache = str(tmp_path / "collectives.json")
    procs = [ctx.Process(target=_entry, args=(fn_name, r, world, port, cache, args, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < expected and time.monotonic() < deadline:
        try:
            rank, status, payload = out.get(timeout=0.5)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and out.empty():
                break
            continue
        (results if status == "ok" else errors)[rank] = payload
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not errors, "rank(s) failed:\n" + "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
    assert not hung, f"rank(s) {hung} still running after {timeout_s} s (killed)"
    assert len(results) >= expected, f"only ranks {sorted(results)} reported; expected {expected}"
    return results
