"""The markdown table the benchmark scripts print (one header row, one row per measurement, padded columns), and
the lines stating the run around it (command, machine, threads, date, load average before and after)."""

from __future__ import annotations


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Print ``rows`` (lists of cells, as strings) under ``header`` as a GitHub markdown table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def run_header() -> str:
    """Lines stating the run above a table: exact command, machine, threads, date, load average before."""
    import datetime
    import os
    import shlex
    import sys

    import torch

    from metainfer_gen.host_allocator import current_allocator

    threads = os.environ.get("OMP_NUM_THREADS")
    command = ("" if threads is None else f"OMP_NUM_THREADS={threads} ") + "python " + shlex.join(sys.argv)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([f"command: {command}", f"machine: {machine()}",
                      f"threads: {torch.get_num_threads()} intra-op (OMP_NUM_THREADS={threads or 'unset'})",
                      f"host allocator: {current_allocator()}",
                      f"date: {now}", f"load average before (1, 5, 15 min): {load_average()}"])


def run_footer(seconds: float) -> str:
    """The line below a table: wall time of the run and the load average after it."""
    return f"run time: {seconds:.0f} s; load average after (1, 5, 15 min): {load_average()}"


BF16_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f")  # /proc/cpuinfo flags behind CPU matmul speed


def machine() -> str:
    """The CPU's model name (``/proc/cpuinfo``), the CPU count, which of :data:`BF16_FLAGS` it has, and whether bf16
    is native (``amx_bf16`` or ``avx512_bf16``) or emulated."""
    import os

    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        text = ""
    fields = {}
    for line in text.splitlines():  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "unknown CPU")
    flags = set(fields.get("flags", "").split())
    have = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in BF16_FLAGS)
    native = "amx_bf16" in flags or "avx512_bf16" in flags
    return f"{name}, {os.cpu_count()} CPUs; flags: {have}; bf16 {'native' if native else 'emulated'}"


def load_average() -> str:
    import os

    return ", ".join(f"{x:.2f}" for x in os.getloadavg())
