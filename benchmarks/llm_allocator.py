"""Our offline engine under each host allocator: glibc as it is, glibc tuned, tcmalloc; a process per row, interleaved.

    OMP_NUM_THREADS=2 python benchmarks/llm_allocator.py                  # bf16, 2 rounds of each row
    OMP_NUM_THREADS=2 python benchmarks/llm_allocator.py --dtype float32 --rounds 3

Each row is a fresh process (``--worker``) that loads serve_llm.py's random-large DeepSeek-V3 (576-wide latent,
saved once under ``--workdir``), warms up as the server does, then runs serve_llm.py's C=64 batch (64 random
prompts of 64-512 tokens, 32 greedy tokens, ``ignore_eos``) ``--batches`` times with fresh prompts, timing each
``LLMEngine.generate``. The allocator is the only difference, each from ``metainfer_gen.host_allocator``'s
``allocator_env`` (what the ``metainfer-gen`` command re-executes under): glibc's malloc as it is, glibc with
``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_``, or Debian's tcmalloc (``libtcmalloc-minimal4``) through
``LD_PRELOAD``, the setting vLLM's CPU docs recommend for its own server. A
decode step allocates and frees tens of MiB of gathered cache rows per layer; glibc serves each from fresh
pages (page faults), tcmalloc reuses them. Prints the batch seconds of every process in order, and per row the
median total tokens/s over its processes' batches after the first, with the ratio to the system allocator's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import build_random_large, random_prompts  # noqa: E402
from serve_loads import OfflineLoad  # noqa: E402
from serve_procs import thread_env  # noqa: E402
from metainfer_gen.host_allocator import ALLOCATOR_ENV, allocator_env, without_ours  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402

# row -> METAINFER_HOST_ALLOCATOR (metainfer_gen.host_allocator.allocator_env: the environment the CLI re-executes in)
ROWS = {"system malloc": "system", "glibc tuned (MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_)": "glibc-tuned",
        "tcmalloc (LD_PRELOAD)": "tcmalloc"}


def worker(path: Path, dtype: str, batches: int, threads: int) -> None:
    """One row's process: print one JSON line per batch (seconds, tokens read and produced)."""
    offline = OfflineLoad(path, 64, 1040, threads, dtype)  # loaded and warmed up as serve_llm.py's offline row
    for seed in range(1, batches + 1):  # the same prompt sets in every process
        prompts = random_prompts(64, 4096, 64, 512, seed)
        start = time.perf_counter()
        outputs = offline.engine.generate(prompts, offline.params(32))
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": sum(map(len, prompts)) + sum(len(o.token_ids)
                                                                                     for o in outputs)}), flush=True)


def run_row(row: str, path: Path, args) -> list[dict]:
    env = without_ours(thread_env(args.threads))
    env.pop("LD_PRELOAD", None)
    env[ALLOCATOR_ENV] = ROWS[row]
    env = allocator_env(env) or env  # raises where tcmalloc is asked for and missing
    command = [sys.executable, __file__, "--worker", "--workdir", args.workdir, "--dtype", args.dtype,
               "--batches", str(args.batches), "--threads", str(args.threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode:
        raise RuntimeError(f"{row}: exit {done.returncode}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/llm_profile", help="where the random checkpoint is saved")
    parser.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (default bfloat16)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per row, interleaved (default 2)")
    parser.add_argument("--batches", type=int, default=3, help="C=64 batches per process (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads per process (default 2)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per process (default 900)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    path = Path(args.workdir) / "random-large"
    if args.worker:
        return worker(path, args.dtype, args.batches, args.threads)
    if not (path / "config.json").exists():
        build_random_large(path)
    print(run_header())
    start = time.perf_counter()
    runs: dict[str, list[list[dict]]] = {row: [] for row in ROWS}
    for _ in range(args.rounds):
        for row in ROWS:
            runs[row].append(run_row(row, path, args))
    base = None
    table = []
    for row in ROWS:
        later = [b["tokens"] / b["seconds"] for batches in runs[row] for b in batches[1:]]
        rate = statistics.median(later)
        base = base or rate
        seconds = " | ".join(" / ".join(f"{b['seconds']:.2f}" for b in batches) for batches in runs[row])
        table.append([row, args.dtype, seconds, f"{rate:,.0f}", f"{rate / base:.2f}x"])
    print_table(["allocator", "dtype", "batch seconds (per process, in order)", "total tok/s (median, later)",
                 "vs system"], table)
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
