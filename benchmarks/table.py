"""The markdown table the benchmark scripts print (one header row, one row per measurement, padded columns)."""

from __future__ import annotations


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Print ``rows`` (lists of cells, as strings) under ``header`` as a GitHub markdown table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
