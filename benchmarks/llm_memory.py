"""The LLM engine's memory at the scale of a real checkpoint: loading, then long contexts, one table each.

    OMP_NUM_THREADS=1 python benchmarks/llm_memory.py                   # both parts (about 8 min the first time)
    OMP_NUM_THREADS=1 python benchmarks/llm_memory.py --part load       # peak RSS while loading, bf16 / FP8, TP 1 / 2
    OMP_NUM_THREADS=1 python benchmarks/llm_memory.py --part context    # peak above the KV pool, 2K-32K context

- ``load`` (:mod:`llm_memory_load`): a random DeepSeek-V3 checkpoint of 2.26 GB in 5 safetensors shards (bf16, and
  DeepSeek's FP8 format), each case loaded in a fresh process; peak host memory above the process's baseline
  against the bytes the rank's weights take. Written to ``benchmarks/results/llm_memory_load.txt``.
- ``context`` (:mod:`llm_memory_context`): prefill at 2K, 8K and 32K context (chunk 2K) and decode of 16 sequences
  at 8K and 32K, each step in a fresh process; peak memory above the KV pool (RSS and tensor storages) against
  the KV-sizing prediction. Written to ``benchmarks/results/llm_memory_context.txt``.

Each part runs as its own script (they measure whole processes), one after the other; the exit status is the
first non-zero one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def part_commands(part: str, workdir: str, quick: bool) -> list[list[str]]:
    """The command lines of the parts to run: ``part`` is "load", "context" or "all"."""
    load = [sys.executable, str(HERE / "llm_memory_load.py"), "--workdir", workdir,
            "--output", str(RESULTS / "llm_memory_load.txt")]
    context = [sys.executable, str(HERE / "llm_memory_context.py"), "--out", str(RESULTS / "llm_memory_context.txt")]
    if quick:
        context.append("--quick")
    return {"load": [load], "context": [context], "all": [load, context]}[part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "load", "context"), default="all", help="which table (default all)")
    parser.add_argument("--workdir", default="/tmp/llm_memory_load",
                        help="where the load part caches its checkpoints (3.3 GB; reused on later runs)")
    parser.add_argument("--quick", action="store_true", help="the context part at 1K-4K only (a smoke run)")
    args = parser.parse_args(argv)
    status = 0
    for command in part_commands(args.part, args.workdir, args.quick):
        print(f"# {' '.join(command[1:])}", flush=True)
        status = status or subprocess.call(command)
    return status


if __name__ == "__main__":
    sys.exit(main())
