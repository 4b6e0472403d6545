"""``--tp N`` for ``metainfer-gen generate`` and ``serve``: start the other tensor-parallel ranks, or join torchrun's.

One command starts everything: without torchrun, this process becomes rank 0 and starts ranks 1..N-1 as
``python -m metainfer_gen.apps.tp_launch`` processes on this host (gloo on the CPU, NCCL on GPUs), each loading
the same checkpoint with the same settings, then following rank 0's steps (:mod:`metainfer_gen.llm.lockstep`)
until it stops them. Under ``torchrun --nproc-per-node N`` (``WORLD_SIZE`` set, equal to N) every rank runs the
command and ranks 1..N-1 follow. Only rank 0 reads prompts, prints, or serves HTTP.

Workers run in their own session (a terminal's Ctrl-C reaches rank 0 only, which then stops them in order) and
watch their parent: if rank 0 dies without stopping them, they exit within a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field



@dataclass
class Ranks:
    """This process's place among the ranks of a ``--tp`` run and, on rank 0, the workers it started."""

    rank: int
    world_size: int
    workers: list[subprocess.Popen] = field(default_factory=list)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Rank 0: wait up to ``timeout_s`` seconds for the workers it started to exit (they exit once the
        lockstep stops), then kill what is left."""
        deadline = time.monotonic() + timeout_s
        for proc in self.workers:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def start_ranks(tp: int, pipeline_kwargs: dict) -> Ranks:
    """Become rank 0 of ``tp`` ranks (starting the others), or take the rank torchrun gave.

    Args:
        tp: tensor-parallel size, >= 1 (1: this process alone, nothing started).
        pipeline_kwargs: what the workers pass to ``TextGenerationPipeline.from_pretrained`` (JSON-able; the
            model path under ``"path"``), the same as rank 0 loads.
    Raises:
        ValueError: under torchrun with ``WORLD_SIZE`` other than ``tp``.
    """
    from metainfer_gen.collectives.distributed import free_port, launched_world_size

    if "WORLD_SIZE" in os.environ:
        world = launched_world_size()
        if world != tp:
            raise ValueError(f"--tp {tp} under torchrun needs --nproc-per-node {tp}; WORLD_SIZE is {world}")
        return Ranks(int(os.environ.get("RANK", "0")), world)
    if tp == 1:
        return Ranks(0, 1)
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(tp)}
    os.environ.update(base | {"RANK": "0", "LOCAL_RANK": "0"})
    workers = []
    for rank in range(1, tp):
        env = os.environ | base | {"RANK": str(rank), "LOCAL_RANK": str(rank), "METAINFER_TP_PARENT": str(os.getpid())}
        workers.append(subprocess.Popen([sys.executable, "-m", "metainfer_gen.apps.tp_launch",
                                         json.dumps(pipeline_kwargs)], env=env, start_new_session=True))
    print(f"tensor parallel: rank 0 is pid {os.getpid()}; started "
          + ", ".join(f"rank {r} (pid {p.pid})" for r, p in enumerate(workers, 1)), file=sys.stderr, flush=True)
    return Ranks(0, tp, workers)


def follow(pipeline_kwargs: dict) -> int:
    """A worker rank: load the pipeline as rank 0 does (with its warm-up), follow rank 0's steps until it stops
    them, then leave the process group. Returns the number of steps run."""
    from metainfer_gen import collectives
    from metainfer_gen.llm.lockstep import Lockstep
    from metainfer_gen.pipelines.text_generation import TextGenerationPipeline

    kwargs = dict(pipeline_kwargs)
    pipe = TextGenerationPipeline.from_pretrained(kwargs.pop("path"), warmup=True, **kwargs)
    try:
        return Lockstep.follow(pipe.engine)
    finally:
        collectives.shutdown_distributed()


@contextlib.contextmanager
def tensor_parallel_pipeline(tp: int, path: str | None, **kwargs):
    """The pipeline on rank 0 (``None`` on a worker rank, after it followed rank 0 to the end).

    With ``tp`` > 1, ranks 1..tp-1 are started (or joined under torchrun), every rank loads ``path`` with
    ``kwargs`` (``TextGenerationPipeline.from_pretrained`` arguments) and warms up, and rank 0's engine leads the
    lockstep. On exit rank 0 stops the other ranks and waits for the ones it started (bounded).

    Raises:
        ValueError: under torchrun with ``WORLD_SIZE`` other than ``tp``; bad settings.
    """
    from metainfer_gen import collectives
    from metainfer_gen.llm.lockstep import Lockstep
    from metainfer_gen.pipelines.text_generation import TextGenerationPipeline

    kwargs = kwargs | ({"tensor_parallel_size": tp} if tp > 1 else {})
    path = None if path is None else str(path)
    ranks = start_ranks(tp, {"path": path, **kwargs})
    if ranks.rank != 0:
        follow({"path": path, **kwargs})
        yield None
        return
    lockstep = None
    try:
        pipe = TextGenerationPipeline.from_pretrained(path, warmup=True, **kwargs)
        if tp > 1:
            lockstep = Lockstep.lead(pipe.engine)
        yield pipe
    finally:
        if lockstep is not None:
            lockstep.stop()
        if tp > 1:
            collectives.shutdown_distributed()
        ranks.stop()


def enable_stack_dumps() -> None:
    """``kill -USR1 PID`` prints every thread's Python stack of this process to its stderr (the standard
    library's faulthandler), so a server or rank that stops answering can be asked where it waits. Writes to the
    process's own stderr (``sys.__stderr__``), which a caller's replacement of ``sys.stderr`` (pytest's capture)
    does not change; without one (no stderr at all) it does nothing."""
    import faulthandler
    import signal

    if sys.__stderr__ is not None and hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def _exit_with_parent(parent: int) -> None:
    """Exit this worker when the rank 0 that started it is gone (no stop message will ever come)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def main() -> int:
    """Worker entry: ``python -m metainfer_gen.apps.tp_launch PIPELINE_KWARGS_JSON`` (started by rank 0)."""
    enable_stack_dumps()
    parent = os.environ.get("METAINFER_TP_PARENT")
    if parent is not None:
        _exit_with_parent(int(parent))
    follow(json.loads(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
