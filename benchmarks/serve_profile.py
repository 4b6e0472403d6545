"""Where our server loses against our offline engine: the engine thread's time split, on the same prompts.

    OMP_NUM_THREADS=1 python benchmarks/serve_profile.py                       # embedded LLM, C=64
    OMP_NUM_THREADS=2 python benchmarks/serve_profile.py --model random-large --dtype bfloat16 --cprofile 25

The server runs in this process as ``metainfer-gen serve`` runs it (:meth:`LLMServer.run_forever`: the engine loop
on the main thread, uvicorn on a thread of its own, the host allocator of :func:`host_allocator.reexec`); the load
generator of ``serve_llm.py`` runs in a child process, as it would against a remote server: one warm-up set of
prompts, then a measured set of different prompts (so the measured run never hits the prefix cache on the warm-up's
blocks). Then the offline engine, in this process, runs the same two sets with its batch capped at C. For both, over
the measured set: wall seconds, engine steps, mean sequences per step, seconds inside ``engine.step`` (schedule +
forward + sample + bookkeeping), between steps (for the server: detokenizing and handing each output to the event
loop, metrics, applying adds / aborts, waiting for the GIL), before the first step / after the last one (the
client's requests arriving; the last chunks going out), and CPU seconds from the first step to the last: the
engine thread's (its span less this is time it waited, for the GIL or for a core) and the whole process's (the
engine thread, its OpenMP workers and, served, uvicorn's thread). ``--cprofile N`` prints the N costliest
functions of the engine thread over the measured set (cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_models import build_random_large, random_prompts  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402

LENGTHS = {"embedded": (32, 256), "random-large": (64, 512)}


class StepTimer:
    """Wraps ``LLMEngine.step`` for every engine of this process (a class-level wrap, undone by :meth:`close`);
    records nothing until ``measuring`` is set, then each step's (start, end, thread CPU at start and end, process
    CPU at start and end, outputs); starts ``profiler`` at the first measured step."""

    def __init__(self, profiler: cProfile.Profile | None = None):
        from metainfer_gen.llm.engine import LLMEngine

        self._cls, self._step, self.profiler = LLMEngine, LLMEngine.step, profiler
        self.measuring = threading.Event()
        self.spans: list[tuple[float, float, float, float, float, float, int]] = []
        timer = self

        def step(engine):
            return timer.timed(engine)

        LLMEngine.step = step

    def timed(self, engine):
        if not self.measuring.is_set():
            return self._step(engine)
        if not self.spans and self.profiler is not None:
            self.profiler.enable()
        start, cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
        outputs = self._step(engine)
        self.spans.append((start, time.perf_counter(), cpu, time.thread_time(), process_cpu, time.process_time(),
                           len(outputs)))
        return outputs

    def close(self) -> None:
        self._cls.step = self._step
        if self.profiler is not None:
            self.profiler.disable()

    def summary(self) -> dict:
        spans = self.spans or [(0.0,) * 7]
        first, last = spans[0], spans[-1]
        return {"steps": len(self.spans), "step_s": sum(s[1] - s[0] for s in self.spans),
                "scheduled": sum(s[6] for s in self.spans), "span_s": last[1] - first[0],
                "thread_cpu_s": last[3] - first[2], "process_cpu_s": last[5] - first[4]}


def client(url: str, prompts_file: str, output_len: int, concurrency: int, timeout_s: float = 900.0) -> None:
    """The child process: wait for the server, run the warm-up set, print ``warm``, run the measured set, print
    its wall seconds and answered count as JSON."""
    from serve_client import run_load
    from serve_procs import wait_for_model

    try:
        model = wait_for_model(url, timeout_s)
    except RuntimeError as exc:
        sys.exit(str(exc))
    warm, measured = json.loads(Path(prompts_file).read_text())
    run_load(url, model, warm, output_len, concurrency=concurrency, timeout_s=timeout_s)
    print("warm", flush=True)
    results, seconds = run_load(url, model, measured, output_len, concurrency=concurrency, timeout_s=timeout_s)
    print(json.dumps([seconds, sum(r.ok for r in results)]), flush=True)


def serve(path, sets, concurrency: int, output_len: int, top: int, dtype: str | None, cprofile: int,
          switch: float | None) -> dict:
    from metainfer_gen.serve.server import LLMServer, ServeConfig
    from serve_procs import free_port

    timer = StepTimer(cProfile.Profile() if cprofile else None)
    port, lines = free_port(), []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(sets, f)
    child = subprocess.Popen([sys.executable, __file__, "--client", f"http://127.0.0.1:{port}/v1", f.name,
                              str(output_len), str(concurrency)], stdout=subprocess.PIPE, text=True)

    def read() -> None:  # the child's "warm" starts the measurement
        for line in child.stdout:
            if line.strip() == "warm":
                timer.measuring.set()
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    engine = {"max_model_len": 1024, **({} if dtype is None else {"dtype": dtype})}
    options = {} if switch is None else {"switch_interval_s": switch}
    try:
        LLMServer.run_forever(ServeConfig(llm=path, port=port, max_num_seqs=top, engine=engine, **options),
                              log_level="warning", stop_when=lambda: child.poll() is not None)
    finally:
        timer.close()
        if child.poll() is None:
            child.kill()
        child.wait(30)
        reader.join(30)
        Path(f.name).unlink()
    if child.returncode != 0 or not lines:
        raise RuntimeError(f"the load generator failed with exit code {child.returncode}: {''.join(lines)[-500:]}")
    seconds, num_ok = json.loads(lines[-1])
    if timer.profiler is not None:
        pstats.Stats(timer.profiler).sort_stats("cumulative").print_stats(cprofile)
    return {"seconds": seconds, "ok": num_ok, **timer.summary()}


def offline(path, sets, concurrency: int, output_len: int, top: int, dtype: str | None) -> dict:
    from metainfer_gen.llm import SamplingParams
    from metainfer_gen.pipelines.text_generation import TextGenerationPipeline

    engine = TextGenerationPipeline.from_pretrained(path, warmup=True, max_num_seqs=top, max_model_len=1024,
                                                    torch_dtype=dtype).engine
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.scheduler.max_num_seqs = concurrency
    timer = StepTimer()
    try:
        engine.generate(sets[0], params)  # the same warm-up set as the server's
        timer.measuring.set()
        start = time.perf_counter()
        engine.generate(sets[1], params)
        seconds = time.perf_counter() - start
    finally:
        timer.close()
    return {"seconds": seconds, "ok": len(sets[1]), **timer.summary()}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        url, prompts_file, output_len, concurrency = argv[1:5]
        client(url, prompts_file, int(output_len), int(concurrency))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(LENGTHS), default="embedded", help="which checkpoint")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="the engine's dtype (default: the platform's, bfloat16 on a CPU with native bf16)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per set (default: the concurrency)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--cprofile", type=int, default=0, help="print the N costliest engine-thread functions")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="the server's GIL switch interval in seconds (default: ServeConfig's)")
    args = parser.parse_args(argv)
    from metainfer_gen import host_allocator

    host_allocator.reexec()  # the allocator `metainfer-gen serve` runs under
    print(run_header())
    begin = time.perf_counter()
    path = None
    if args.model == "random-large":
        path = str(build_random_large(Path(tempfile.mkdtemp(prefix="serve_profile_")) / "rl"))
    vocab = 4096
    if path is None:
        from metainfer_gen.pipelines.text_generation import default_llm_dir

        vocab = json.loads((default_llm_dir() / "config.json").read_text())["vocab_size"]
    num = args.num_prompts or args.concurrency
    sets = [random_prompts(num, vocab, *LENGTHS[args.model], seed) for seed in (7, 8)]  # warm-up, measured
    top = max(64, args.concurrency)
    rows = []
    for name, r in (("ours serve", serve(path, sets, args.concurrency, args.output_len, top, args.dtype,
                                         args.cprofile, args.switch_interval)),
                    ("ours offline", offline(path, sets, args.concurrency, args.output_len, top, args.dtype))):
        tokens = sum(map(len, sets[1])) + r["ok"] * args.output_len
        rows.append([args.model, f"C={args.concurrency}", name, f"{r['seconds']:.2f}",
                     f"{tokens / r['seconds']:,.0f}", str(r["steps"]), f"{r['scheduled'] / max(1, r['steps']):.1f}",
                     f"{r['step_s']:.2f}", f"{r['step_s'] / max(1, r['steps']) * 1e3:.1f}",
                     f"{r['span_s'] - r['step_s']:.2f}", f"{r['seconds'] - r['span_s']:.2f}",
                     f"{r['thread_cpu_s']:.2f}", f"{r['process_cpu_s']:.2f}"])
    print_table(["model", "load", "impl", "wall s", "total tok/s", "steps", "outputs/step", "in step s", "ms/step",
                 "between steps s", "before first / after last step s", "engine thread CPU s", "process CPU s"],
                rows)
    print(f"dtype: {args.dtype or 'the platform default'}; prompts per set: {num}; output tokens: {args.output_len}")
    print(run_footer(time.perf_counter() - begin))


if __name__ == "__main__":
    main()
