"""The tables of ``serve_llm.py``, one row group per (model, dtype): every load of every implementation (a side that
failed is one row with its error), the ours-vs-vLLM summary, and the batch seconds. Ratios never cross dtypes."""

from __future__ import annotations

import statistics

from serve_client import Summary
from serve_loads import IMPLS, OFFLINE, OURS, VLLM, VLLM_OFFLINE, VLLM_PRELOAD, Measured, Workload
from table import print_table

Group = tuple[str, str, dict[str, Measured], Workload]  # model, dtype, impl -> Measured, its prompts

MAIN_HEADER = ["model", "dtype", "load", "impl", "req/s", "input tok/s", "output tok/s", "total tok/s",
               "TTFT ms p50/p95/p99", "TPOT ms p50/p95/p99", "ITL ms p50/p95/p99", "vs offline", "failed", "error"]
SUMMARY_HEADER = ["model", "dtype", "load", "ours serve / vllm serve best", "vllm serve best",
                  "TTFT p95 ms (ours vs best)", "TPOT p95 ms (ours vs best)", "ours offline / vllm offline"]


def _lat(values: tuple[float, float, float] | None) -> str:
    return "-" if values is None or values[0] != values[0] else " / ".join(f"{v:,.0f}" for v in values)


def _p95(s: Summary, field: str) -> str:
    value = getattr(s, field)[1]
    return "-" if value != value else f"{value:,.0f}"


def _ratio(a: Summary | None, b: Summary | None) -> str:
    return f"{a.total_throughput / b.total_throughput:.2f}x" if a and b and b.total_throughput else "-"


def load_rows(group: Group, loads: list[str]) -> list[list[str]]:
    """One row per (load, implementation) that ran; "vs offline" is total tok/s over ours offline's (same dtype,
    same load). A side that failed as a whole: one row, load "all", failed "all", its error."""
    name, dtype, results, _ = group
    rows = []
    for load in loads:
        ceiling = results.get(OFFLINE, Measured()).rows.get(load)
        for impl in IMPLS:
            s = results.get(impl, Measured()).rows.get(load)
            if s is None:
                continue
            ratio = f"{s.total_throughput / ceiling.total_throughput:.0%}" if ceiling else "-"
            rows.append([name, dtype, load, impl, f"{s.request_throughput:.2f}", f"{s.input_throughput:,.0f}",
                         f"{s.output_throughput:,.1f}", f"{s.total_throughput:,.0f}", _lat(s.ttft_ms),
                         _lat(s.tpot_ms), _lat(s.itl_ms), ratio, str(s.num_failed), s.first_error[:80]])
    for impl in IMPLS:
        m = results.get(impl)
        if m is not None and m.error:
            rows.append([name, dtype, "all", impl] + ["-"] * 8 + ["all", m.error])
    return rows


def summary_rows(group: Group, loads: list[str]) -> list[list[str]]:
    """Per load: ours serve over the faster vLLM server (of serve and +preload, by total tok/s), and ours offline
    over vLLM offline; only where vLLM ran. All vLLM sides failed: one row with the first one's error."""
    name, dtype, results, _ = group
    vllm = [results[impl] for impl in (VLLM, VLLM_PRELOAD, VLLM_OFFLINE) if impl in results]
    if not vllm:
        return []
    if all(m.error for m in vllm):
        return [[name, dtype, "all", "-", f"vLLM failed: {vllm[0].error}", "-", "-", "-"]]
    rows = []
    for load in loads:
        ours, offline = (results.get(impl, Measured()).rows.get(load) for impl in (OURS, OFFLINE))
        servers = [(impl, results[impl].rows[load]) for impl in (VLLM, VLLM_PRELOAD)
                   if impl in results and load in results[impl].rows]
        best_impl, best = max(servers, key=lambda x: x[1].total_throughput) if servers else ("-", None)
        theirs_offline = results.get(VLLM_OFFLINE, Measured()).rows.get(load)
        if best is None and theirs_offline is None:
            continue
        pair = (lambda f: f"{_p95(ours, f)} vs {_p95(best, f)}") if ours and best else (lambda f: "-")
        rows.append([name, dtype, load, _ratio(ours, best), best_impl, pair("ttft_ms"), pair("tpot_ms"),
                     _ratio(offline, theirs_offline)])
    return rows


def _seconds(values: list[float]) -> str:
    return " / ".join(f"{s:.2f}" for s in values) if values else "-"


def batch_rows(group: Group) -> list[list[str]]:
    """Per implementation: the seconds of each batch at the top concurrency and of each prefill set, in order."""
    name, dtype, results, work = group
    rows = []
    for impl in IMPLS:
        m = results.get(impl)
        batches = m.seconds.get(work.top_label, []) if m else []
        if not batches:
            continue
        later = statistics.median(batches[1:]) if len(batches) > 1 else float("nan")
        prefill = m.seconds.get(work.prefill_label, []) if work.prefill else []
        rows.append([name, dtype, impl, _seconds(batches), f"{batches[0] / later - 1:+.0%}",
                     f"{m.rows[work.top_label].total_throughput:,.0f}", _seconds(prefill),
                     "-" if m.startup_s is None else f"{m.startup_s:.0f}"])
    return rows


def print_report(groups: list[Group], loads: list[str], top: int) -> None:
    print_table(MAIN_HEADER, [r for g in groups for r in load_rows(g, loads)])
    summary = [r for g in groups for r in summary_rows(g, loads)]
    if summary:
        print("\nours vs vLLM, total tok/s, within one dtype (vllm serve best: the faster of vllm serve and "
              "+preload at that load; vllm offline ran the top concurrency and the prefill load only)")
        print_table(SUMMARY_HEADER, summary)
    batches = [r for g in groups for r in batch_rows(g)]
    if batches:
        print()
        print_table(["model", "dtype", "impl", f"batch seconds (C={top}, in order)", "first vs later (median)",
                     "total tok/s (row: fastest later batch)", "prefill set seconds (row: fastest after the first)",
                     "startup s"], batches)
    for name, dtype, results, _ in groups:
        for impl, m in results.items():
            if m.error:
                print(f"\n{name}, {dtype}, {impl}: FAILED: {m.error}\n  " + m.detail.replace("\n", "\n  "))
