"""First 64-prompt batch in a fresh process vs the later ones, with and without the engine's start-up warm-up.

    OMP_NUM_THREADS=1 python benchmarks/llm_first_batch.py                 # random-large (576-wide latent)
    python benchmarks/llm_first_batch.py --quick                           # small shapes (smoke run)

Each run is a fresh Python process (``--child``): load the engine (max_num_seqs 64, max_model_len 1024,
max_num_batched_tokens 2048, as ``serve_llm.py``), optionally ``engine.warmup()``, a 2-request warm-up call (what
``serve_llm.py`` sends a server first), then ``--batches`` batches of 64 random prompts (64-512 tokens, 32 greedy
tokens each, a new seed per batch). Runs alternate between the two settings (``--rounds`` times), so drifting load
from other work hits both alike. The row gives every batch's seconds and first vs later (median); without the
warm-up the first batch pays torch.compile for the full-budget step's shapes (see ``metainfer_gen/llm/warmup.py``).
Batch times on a shared machine vary more than a compile costs, so the rows also give the graphs compiled and the
seconds dynamo spent compiling during the batches (``_compile.compile_inner``), against a later batch's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_models import build_random_large, random_prompts  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402


def child(path: Path, warmup: bool, batches: int, quick: bool) -> dict:
    """One fresh process's figures: load and warm-up seconds, graphs compiled, each batch's seconds."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters

    from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams

    start = time.perf_counter()
    engine = LLMEngine.from_pretrained(path, EngineConfig(max_num_seqs=64, max_model_len=1024))
    load_s = time.perf_counter() - start
    report = engine.warmup() if warmup else None
    greedy = dict(temperature=0.0, ignore_eos=True)
    engine.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_new_tokens=2, **greedy))
    vocab, (lo, hi) = engine.model.config.vocab_size, ((8, 64) if quick else (64, 512))
    params = SamplingParams(max_new_tokens=4 if quick else 32, **greedy)
    def compile_s() -> float:
        return sum(compilation_time_metrics.get("_compile.compile_inner", []))

    seconds, graphs, compiled = [], counters["stats"]["unique_graphs"], compile_s()
    for seed in range(1, batches + 1):
        prompts = random_prompts(64, vocab, lo, hi, seed)
        t = time.perf_counter()
        engine.generate(prompts, params)
        seconds.append(time.perf_counter() - t)
    return {"load_s": load_s, "warmup_s": report.seconds if report else None, "threads": torch.get_num_threads(),
            "graphs_in_batches": counters["stats"]["unique_graphs"] - graphs, "compile_s": compile_s() - compiled,
            "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    parser.add_argument("--batches", type=int, default=4, help="64-prompt batches per process (default 4)")
    parser.add_argument("--rounds", type=int, default=1, help="processes per setting, alternating (default 1)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # checkpoint path: run one process
    parser.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child), args.warmup, args.batches, args.quick)))
        return
    print(run_header())
    start = time.perf_counter()
    path = build_random_large(Path(tempfile.mkdtemp(prefix="first_batch_")) / "rl", quick=args.quick)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    rows = []
    for _ in range(args.rounds):
        for warmup in (False, True):
            command = [sys.executable, __file__, "--child", str(path), "--batches", str(args.batches)]
            command += ["--warmup"] * warmup + ["--quick"] * args.quick
            out = json.loads(subprocess.run(command, env=env, check=True, capture_output=True, text=True,
                                            timeout=1800).stdout.strip().splitlines()[-1])
            s = out["seconds"]
            later = statistics.median(s[1:]) if len(s) > 1 else s[0]
            rows.append(["random-large", "engine.warmup()" if warmup else "none",
                         "-" if out["warmup_s"] is None else f"{out['warmup_s']:.1f}", f"{out['load_s']:.1f}",
                         " / ".join(f"{x:.2f}" for x in s), f"{(s[0] / later - 1):+.0%}",
                         str(out["graphs_in_batches"]), f"{out['compile_s']:.1f}",
                         f"{out['compile_s'] / later:.0%}"])
    print(f"64 prompts per batch, uniform {'8-64' if args.quick else '64-512'} tokens, "
          f"{4 if args.quick else 32} greedy tokens each; a fresh process per row; threads per process: "
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print_table(["model", "warm-up", "warm-up s", "load s", "batch seconds (in order)", "first vs later (median)",
                 "graphs compiled in batches", "compile s in batches", "compile s / later batch"], rows)
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
