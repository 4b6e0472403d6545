"""The loads of ``serve_llm.py``: the prompt sets one model runs (:class:`Workload`, as :class:`Point` runs), what
one implementation gave on them (:class:`Measured`), and the three ways to run them: a server over HTTP
(:class:`ServerLoad`), our offline engine in this process (:class:`OfflineLoad`), vLLM's offline ``LLM.generate`` in
its own venv (:func:`measure_vllm_offline`). Failures become :class:`Measured` errors (:func:`short_error`).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from serve_client import Summary, run_load, summarize, summarize_results
from serve_models import random_prompts
from serve_procs import ServerProcess, vllm_env, vllm_options

OURS, OFFLINE, VLLM, VLLM_PRELOAD = "ours serve", "ours offline", "vllm serve", "vllm serve +preload"
VLLM_OFFLINE = "vllm offline +preload"
IMPLS = (OURS, OFFLINE, VLLM, VLLM_PRELOAD, VLLM_OFFLINE)
NAN3 = (float("nan"),) * 3


def label(concurrency: int | None = None, rate: float | None = None) -> str:
    return f"C={concurrency}" if rate is None else f"{rate:g} req/s"


@dataclass(frozen=True)
class Point:
    """One run: ``prompts`` with at most ``concurrency`` in flight, ``output_len`` tokens each, row ``label``."""

    label: str
    concurrency: int
    prompts: list[list[int]]
    output_len: int


@dataclass
class Workload:
    """One model's prompts, the same for every implementation and dtype. ``batches``: the sets run back to back at
    the largest concurrency; ``sweep``: concurrency -> prompts for the others; ``rates``: req/s -> prompts;
    ``prefill``: the prefill-heavy sets (all prompts at once, ``prefill_output_len`` tokens each), run back to back.
    A label run several times gets the fastest run after the first as its row (``rounds.py``'s rule: load from
    other work only ever slows a run down; the first may pay one-off costs)."""

    batches: list[list[list[int]]]
    sweep: dict[int, list[list[int]]]
    rates: dict[float, list[list[int]]]
    output_len: int
    prefill: list[list[list[int]]] = field(default_factory=list)
    prefill_label: str = ""
    prefill_output_len: int = 4

    @property
    def top(self) -> int:
        return len(self.batches[0])

    @property
    def top_label(self) -> str:
        return label(self.top)

    @property
    def max_num_seqs(self) -> int:
        """The running batch both engines need: the largest concurrency or prefill set."""
        return max([self.top] + [len(p) for p in self.prefill])

    def points(self) -> list[Point]:
        """The runs in order: the batches at the top concurrency, the other concurrencies, the prefill sets."""
        return ([Point(self.top_label, self.top, p, self.output_len) for p in self.batches]
                + [Point(label(c), c, p, self.output_len) for c, p in self.sweep.items()]
                + [Point(self.prefill_label, len(p), p, self.prefill_output_len) for p in self.prefill])


def make_workload(vocab: int, lengths: tuple[int, int], concurrencies: list[int], rates: list[float],
                  num_prompts: int | None, rate_prompts: int, batch_repeats: int, output_len: int,
                  prefill: tuple[int, int, int, int, int] | None = None) -> Workload:
    """``prefill``: (prompts per set, shortest, longest, output tokens, sets) or None for no prefill-heavy load."""
    top = max(concurrencies)
    seed = iter(range(1, 10_000))  # a fresh seed per set: no two sets share a prefix-cache block
    batches = [random_prompts(top, vocab, *lengths, next(seed)) for _ in range(batch_repeats)]
    sweep = {c: random_prompts(num_prompts or min(max(8, 2 * c), top), vocab, *lengths, next(seed))
             for c in concurrencies if c != top}
    work = Workload(batches, sweep, {r: random_prompts(rate_prompts, vocab, *lengths, next(seed)) for r in rates},
                    output_len)
    if prefill is not None:
        num, lo, hi, out, sets = prefill
        work.prefill = [random_prompts(num, vocab, lo, hi, next(seed)) for _ in range(sets)]
        work.prefill_label, work.prefill_output_len = f"prefill {num}x{lo}-{hi}", out
    return work


@dataclass
class Measured:
    """What one implementation gave on one model in one dtype: ``rows`` (load label -> Summary), ``seconds``
    (label -> the wall seconds of each of its runs, in order), or ``error`` (short) with ``detail`` (log tail)."""

    rows: dict[str, Summary] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=dict)
    startup_s: float | None = None
    error: str = ""
    detail: str = ""


def collect(runs: list[tuple[Point, Summary]], startup_s: float | None) -> Measured:
    """(point, summary) pairs in run order -> rows (per label the fastest run after the first, by total tok/s)."""
    groups: dict[str, list[Summary]] = {}
    for point, summary in runs:
        groups.setdefault(point.label, []).append(summary)
    out = Measured(startup_s=startup_s)
    for name, summaries in groups.items():
        out.rows[name] = max(summaries[1:] or summaries, key=lambda s: s.total_throughput)
        out.seconds[name] = [s.seconds for s in summaries]
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION = re.compile(r"\b([A-Z][A-Za-z0-9_.]*(?:Error|Exception)): (.+)")
_WRAPPERS = ("Engine core initialization failed", "See root cause above", "exited with", "did not answer")


def short_error(log: str, fallback: str, width: int = 120) -> str:
    """The first meaningful line of a failure: the first ``XError: message`` line of ``log`` that is neither a
    warning nor a wrapper (vLLM's API server reports its engine core's error as "Engine core initialization
    failed"), else the first non-empty line of ``fallback``; cut to ``width`` characters."""
    lines = _ANSI.sub("", log).splitlines()
    found = [m for m in map(_EXCEPTION.search, lines)
             if m and "WARNING" not in m.string and not any(w in m.group(0) for w in _WRAPPERS)]
    text = (f"{found[0].group(1).rsplit('.', 1)[-1]}: {found[0].group(2).strip()}" if found else
            next((line.strip() for line in fallback.splitlines() if line.strip()), "unknown error"))
    return text if len(text) <= width else text[:width - 3] + "..."


def failure(log_path: Path | None, exc: BaseException) -> Measured:
    """A side that failed: its short error (from its log when there is one) and the log's last lines."""
    try:
        log = log_path.read_text(errors="replace") if log_path is not None else ""
    except OSError:
        log = ""
    detail = "\n".join(_ANSI.sub("", log).splitlines()[-4:]) or str(exc)
    return Measured(error=short_error(log, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__),
                    detail=detail)


class ServerLoad:
    """A started server (ours or vLLM's) as something to run loads on; warmed up with 2 short requests."""

    def __init__(self, server: ServerProcess, timeout_s: float):
        self.server, self.timeout_s = server, timeout_s
        run_load(server.base_url, server.model, [[5, 6, 7, 8]] * 2, 2, concurrency=2, timeout_s=timeout_s)

    def run(self, point: Point) -> Summary:
        return summarize_results(*run_load(self.server.base_url, self.server.model, point.prompts, point.output_len,
                                           concurrency=point.concurrency, timeout_s=self.timeout_s))

    def at_rate(self, rate: float, prompts: list[list[int]], output_len: int) -> Summary:
        return summarize_results(*run_load(self.server.base_url, self.server.model, prompts, output_len,
                                           rate=rate, seed=int(rate * 1000), timeout_s=self.timeout_s))

    def rates(self, work: Workload) -> dict[str, Summary]:
        return {label(rate=r): self.at_rate(r, p, work.output_len) for r, p in work.rates.items()}

    def measure(self, work: Workload) -> Measured:
        out = collect([(p, self.run(p)) for p in work.points()], self.server.startup_s)
        out.rows.update(self.rates(work))
        return out


class OfflineLoad:
    """Our ``LLMEngine.generate`` in this process (``EngineConfig(dtype=...)``), its running batch capped at the
    client's concurrency."""

    def __init__(self, path: Path | None, max_num_seqs: int, max_model_len: int, threads: int, dtype: str):
        import torch

        from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
        from metainfer_gen.pipelines.text_generation import default_llm_dir

        torch.set_num_threads(threads)
        start = time.perf_counter()
        self.engine = LLMEngine.from_pretrained(path or default_llm_dir(), EngineConfig(
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, dtype=dtype))
        self.engine.warmup()  # as the server does at start-up
        self.params = lambda n: SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        self.engine.generate([[5, 6, 7, 8]] * 2, self.params(2))
        self.startup_s = time.perf_counter() - start

    def run(self, point: Point) -> Summary:
        self.engine.scheduler.max_num_seqs = point.concurrency  # the same cap the client puts on the server
        start = time.perf_counter()
        outputs = self.engine.generate(point.prompts, self.params(point.output_len))
        seconds = time.perf_counter() - start
        return summarize([len(p) for p in point.prompts], [len(o.token_ids) for o in outputs],
                         [o.ttft for o in outputs],
                         [o.mean_token_latency for o in outputs if o.mean_token_latency is not None], None, seconds)


def measure_vllm_offline(vllm_python: str, path: Path, work: Workload, threads: int, dtype: str, max_model_len: int,
                         tmp: Path, timeout_s: float, options: tuple[int | None, str | None] = (None, None)
                         ) -> Measured:
    """vLLM's ``LLM.generate`` (with the LD_PRELOAD) on the top-concurrency batches and the prefill sets (each set
    submitted at once), via ``vllm_offline.py`` in vLLM's venv. No per-request latencies (``-`` in the table).
    ``options``: block size and attention backend as :func:`serve_procs.vllm_options` (None: vLLM's choice)."""
    points = [p for p in work.points() if p.label in (work.top_label, work.prefill_label)]
    sets, times, log = tmp / f"vllm_sets_{dtype}.json", tmp / f"vllm_times_{dtype}.json", tmp / f"vllm_{dtype}.log"
    sets.write_text(json.dumps([{"prompts": p.prompts, "max_tokens": p.output_len} for p in points]))
    command = [vllm_python, str(Path(__file__).with_name("vllm_offline.py")), "--model", str(path), "--prompts",
               str(sets), "--out", str(times), "--max-num-seqs", str(work.max_num_seqs), "--max-model-len",
               str(max_model_len), "--dtype", dtype, *vllm_options(*options)]
    try:
        env = vllm_env(vllm_python, threads, preload=True)
    except FileNotFoundError as exc:
        return failure(None, exc)
    with open(log, "w") as f:
        proc = subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return failure(None, TimeoutError(f"vLLM offline did not finish within {timeout_s:.0f} s"))
    finally:
        ServerProcess("vllm offline", proc, "", log).stop(grace_s=5)
    if proc.returncode != 0 or not times.exists():
        return failure(log, RuntimeError(f"vLLM offline exited with {proc.returncode}"))
    summaries = []
    for r in json.loads(times.read_text()):
        s = r["seconds"]
        summaries.append(Summary(r["num_prompts"], 0, s, r["num_prompts"] / s, r["num_prompt_tokens"] / s,
                                 r["num_output_tokens"] / s, NAN3, NAN3, None))
    return collect(list(zip(points, summaries)), None)
