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

    threads = os.environ.get("OMP_NUM_THREADS")
    command = ("" if threads is None else f"OMP_NUM_THREADS={threads} ") + "python " + shlex.join(sys.argv)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([f"command: {command}", f"machine: {machine()}",
                      f"threads: {torch.get_num_threads()} intra-op (OMP_NUM_THREADS={threads or 'unset'})",
                      f"date: {now}", f"load average before (1, 5, 15 min): {load_average()}"])


def run_footer(seconds: float) -> str:
    """The line below a table: wall time of the run and the load average after it."""
    return f"run time: {seconds:.0f} s; load average after (1, 5, 15 min): {load_average()}"


def machine() -> str:
    """``lscpu``'s model name, the CPU count, and whether the CPU has native bf16 (``avx512_bf16``, AMX)."""
    import os
    import subprocess

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    flags = set(fields.get("Flags", "").split())
    bf16 = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags]
    return (f"{name}, {os.cpu_count()} CPUs, " + (f"{' and '.join(bf16)} present" if bf16 else
                                                   "no avx512_bf16 (bf16 emulated)"))


def load_average() -> str:
    import os

    return ", ".join(f"{x:.2f}" for x in os.getloadavg())
