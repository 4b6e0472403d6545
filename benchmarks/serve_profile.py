"""Where our server loses against our offline engine: the engine thread's time split, on the same prompts.

    OMP_NUM_THREADS=1 python benchmarks/serve_profile.py                       # embedded LLM, C=64
    python benchmarks/serve_profile.py --model random-large --concurrency 16 --cprofile 25

The server runs in this process (so its engine thread can be timed); the load generator of ``serve_llm.py`` runs
in a child process, as it would against a remote server. Then the offline engine runs the same prompts with its
batch capped at C. For both: wall seconds, engine steps, mean sequences per step, seconds inside
``engine.step`` (schedule + forward + sample + bookkeeping), between steps (for the server: detokenizing and
handing each output to the event loop, metrics, applying adds / aborts, waiting for the GIL), and before the first
step / after the last one (the client's connections and requests arriving; the last chunks going out).
``--cprofile N`` prints the N costliest functions of the engine thread (cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_models import build_random_large, random_prompts  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402

LENGTHS = {"embedded": (32, 256), "random-large": (64, 512)}


class StepTimer:
    """Wraps ``engine.step``: count, seconds inside, sequences scheduled per step."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step
        self.num_steps, self.seconds, self.num_scheduled = 0, 0.0, 0
        self.spans: list[tuple[float, float, int]] = []  # (start, end, outputs) of every step
        engine.step = self

    @property
    def span_s(self) -> float:
        """Seconds from the first step's start to the last step's end."""
        return self.spans[-1][1] - self.spans[0][0] if self.spans else 0.0

    def __call__(self):
        start = time.perf_counter()
        outputs = self.step()
        end = time.perf_counter()
        self.seconds += end - start
        self.spans.append((start, end, len(outputs)))
        self.num_steps += 1
        self.num_scheduled += len(outputs)
        return outputs


def serve(path, prompts, concurrency: int, output_len: int, top: int, cprofile: int, switch: float | None) -> dict:
    from metainfer_gen.serve.async_engine import AsyncLLMEngine
    from metainfer_gen.serve.server import LLMServer, ServeConfig

    profiler = cProfile.Profile() if cprofile else None
    run = AsyncLLMEngine._run
    thread_s = {}

    def timed_run(front):  # the engine thread's whole life, with its CPU time
        start, cpu = time.perf_counter(), time.thread_time()
        if profiler is not None:
            profiler.runcall(run, front)
        else:
            run(front)
        thread_s.update(wall=time.perf_counter() - start, cpu=time.thread_time() - cpu)

    AsyncLLMEngine._run = timed_run
    try:
        options = {} if switch is None else {"switch_interval_s": switch}
        server = LLMServer.start(ServeConfig(llm=path, port=0, max_num_seqs=top, engine={"max_model_len": 1024},
                                             **options), timeout_s=600)
    finally:
        AsyncLLMEngine._run = run
    timer = StepTimer(server.front.engine)
    load = [sys.executable, "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); from serve_client import "
            "run_load; r, s = run_load(sys.argv[2], sys.argv[3], json.load(open(sys.argv[4])), int(sys.argv[5]), "
            "concurrency=int(sys.argv[6])); print(json.dumps([s, sum(x.ok for x in r)]))",
            str(Path(__file__).parent), server.base_url, server.model_name]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    with server:
        subprocess.run(load + [f.name, str(output_len), str(concurrency)], check=True, capture_output=True)  # warm
        timer.num_steps, timer.seconds, timer.num_scheduled = 0, 0.0, 0
        timer.spans.clear()
        if profiler is not None:
            profiler.enable()
        cpu0 = time.process_time()
        out = subprocess.run(load + [f.name, str(output_len), str(concurrency)], check=True, capture_output=True,
                             text=True)
        process_cpu = time.process_time() - cpu0
        seconds, num_ok = json.loads(out.stdout.strip().splitlines()[-1])
    os.unlink(f.name)
    if profiler is not None:
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(cprofile)
    return {"seconds": seconds, "ok": num_ok, "steps": timer.num_steps, "step_s": timer.seconds,
            "scheduled": timer.num_scheduled, "process_cpu_s": process_cpu, "span_s": timer.span_s}


def offline(path, prompts, concurrency: int, output_len: int, top: int) -> dict:
    from metainfer_gen.llm import SamplingParams
    from metainfer_gen.pipelines.text_generation import TextGenerationPipeline

    engine = TextGenerationPipeline.from_pretrained(path, warmup=True, max_num_seqs=top, max_model_len=1024).engine
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.scheduler.max_num_seqs = concurrency
    engine.generate(prompts, params)  # same warm run as the server's
    timer = StepTimer(engine)
    cpu0 = time.process_time()
    start = time.perf_counter()
    engine.generate(prompts, params)
    return {"seconds": time.perf_counter() - start, "ok": len(prompts), "steps": timer.num_steps,
            "step_s": timer.seconds, "scheduled": timer.num_scheduled, "process_cpu_s": time.process_time() - cpu0,
            "span_s": timer.span_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(LENGTHS), default="embedded", help="which checkpoint")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts (default: the concurrency)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--cprofile", type=int, default=0, help="print the N costliest engine-thread functions")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="the server's GIL switch interval in seconds (default: ServeConfig's)")
    args = parser.parse_args(argv)

    print(run_header())
    begin = time.perf_counter()
    path = None
    if args.model == "random-large":
        path = str(build_random_large(Path(tempfile.mkdtemp(prefix="serve_profile_")) / "rl"))
    vocab = 4096
    if path is None:
        from metainfer_gen.pipelines.text_generation import default_llm_dir

        vocab = json.loads((default_llm_dir() / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_prompts or args.concurrency, vocab, *LENGTHS[args.model], 7)
    top = max(64, args.concurrency)
    rows = []
    for name, result in (("ours serve", serve(path, prompts, args.concurrency, args.output_len, top, args.cprofile,
                                                      args.switch_interval)),
                         ("ours offline", offline(path, prompts, args.concurrency, args.output_len, top))):
        r = result
        tokens = sum(map(len, prompts)) + r["ok"] * args.output_len
        rows.append([args.model, f"C={args.concurrency}", name, f"{r['seconds']:.2f}", f"{tokens / r['seconds']:,.0f}",
                     str(r["steps"]), f"{r['scheduled'] / max(1, r['steps']):.1f}", f"{r['step_s']:.2f}",
                     f"{r['step_s'] / max(1, r['steps']) * 1e3:.1f}", f"{r['span_s'] - r['step_s']:.2f}",
                     f"{r['seconds'] - r['span_s']:.2f}",
                     f"{r['process_cpu_s']:.2f}"])
    print_table(["model", "load", "impl", "wall s", "total tok/s", "steps", "outputs/step", "in step s", "ms/step",
                 "between steps s",
                 "before first / after last step s", "process CPU s"], rows)
    print(run_footer(time.perf_counter() - begin))


if __name__ == "__main__":
    main()
