"""The compiled CPU decode step against the eager one: decode-step time per batch size, with the tokens compared.

    OMP_NUM_THREADS=2 python benchmarks/llm_decode_step.py                 # serve_llm.py's random-large, bf16 default
    OMP_NUM_THREADS=2 python benchmarks/llm_decode_step.py --batches 1,16 --rounds 2 --dtype float32
    OMP_NUM_THREADS=2 python benchmarks/llm_decode_step.py --dtype float32 --baseline folded-experts

Two warmed-up engines on serve_llm.py's random-large DeepSeek-V3 (576-wide latent) in one process: ``enforce_eager``
(every decode step eager) and the default (one compiled graph per batch-size bucket, ``llm/compiled_decode.py``).
Rows are interleaved (round by round, batch by batch, eager then compiled) on the same prompts (64-256 random token
ids, ``--output-len`` greedy tokens, ``ignore_eos``); a row is the median decode-only step (every sequence one token)
over its rounds. Quality beside each speed-up: both engines' greedy tokens against a float32 eager engine's (the
reference; not timed), per sequence the share of positions before the first difference (mean and worst), since one
near-tied argmax changes everything after it; and the compiled engine's against the eager one's.

``--baseline folded-experts`` replaces the eager engine by a compiled one whose MoE layers fold every routed expert
into two GEMMs of the graph (``moe_experts_folded``) instead of calling the C++ experts
(:mod:`metainfer_gen.kernels.moe_cpu`): the compiled step before and after that kernel, same interleaving.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import random_large_pipeline, random_prompts  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402

from metainfer_gen import host_allocator  # noqa: E402
from metainfer_gen.llm.layers.moe import MoE  # noqa: E402
from metainfer_gen.llm.sequence import SamplingParams  # noqa: E402


def timed_generate(engine, prompts, params) -> tuple[list[float], list[list[int]]]:
    """(seconds of each decode-only step, generated tokens per prompt) of one ``generate``."""
    run, steps = engine.runner.run, []

    def timing(out):
        start = time.perf_counter()
        sampled = run(out)
        if out.scheduled and all(item.num_tokens == 1 for item in out.scheduled):
            steps.append(time.perf_counter() - start)
        return sampled

    engine.runner.run = timing
    try:
        outputs = engine.generate(prompts, params)
    finally:
        engine.runner.run = run
    return steps, [o.token_ids for o in outputs]


@contextlib.contextmanager
def _experts_folded(on: bool):
    """While on, MoE layers traced into a compiled step fold every expert into the graph (the path before the C++
    experts)."""
    saved = MoE._cpp_in_graph
    if on:
        MoE._cpp_in_graph = lambda self, x, ids: False
    try:
        yield
    finally:
        MoE._cpp_in_graph = saved


def agreement(a: list[int], b: list[int]) -> float:
    """Share of positions before the first token that differs."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(a), 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/llm_profile", help="where the random checkpoint is saved")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes (default 1,16,64)")
    parser.add_argument("--rounds", type=int, default=3, help="generate calls per row (default 3)")
    parser.add_argument("--output-len", type=int, default=33, help="greedy tokens per prompt (default 33)")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the engine's default)")
    parser.add_argument("--baseline", choices=("eager", "folded-experts"), default="eager",
                        help="the engine the compiled one is compared with (default eager)")
    args = parser.parse_args(argv)
    if argv is None:  # under the host allocator `metainfer-gen serve` runs with (tcmalloc where installed)
        host_allocator.reexec()
    batches = [int(b) for b in args.batches.split(",")]
    started = time.perf_counter()
    print(run_header())
    engines = {}
    folded = args.baseline == "folded-experts"
    base = "folded" if folded else "eager"
    for mode, dtype, options in ((base, args.dtype, {} if folded else {"enforce_eager": True}),
                                 ("compiled", args.dtype, {}), ("reference", "float32", {"enforce_eager": True})):
        t0 = time.perf_counter()
        with _experts_folded(mode == "folded"):  # the choice is traced during the warm-up's compiles
            pipe, _, _ = random_large_pipeline(args.workdir, max(batches), "64,256", args.output_len, dtype,
                                               **options)
        engines[mode] = pipe.engine
        print(f"{mode}: decode path {pipe.engine.decode_path}, dtype {pipe.engine.dtype}, load + warm-up "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    steps = {(mode, b): [] for mode in engines for b in batches}  # the reference's are not reported
    tokens = {}
    for r in range(args.rounds):
        for b in batches:
            prompts = random_prompts(b, 1000, 64, 256, seed=100 * r + b)
            for mode, engine in engines.items():
                times, out = timed_generate(engine, prompts, params)
                steps[mode, b].append(statistics.median(times))
                tokens[mode, b, r] = out
    rows = []
    for b in batches:
        eager, compiled = (statistics.median(steps[m, b]) * 1e3 for m in (base, "compiled"))
        quality = []
        for one, other in ((base, "reference"), ("compiled", "reference"), ("compiled", base)):
            shares = [agreement(x, y) for r in range(args.rounds)
                      for x, y in zip(tokens[one, b, r], tokens[other, b, r])]
            quality.append(f"{statistics.mean(shares):.1%} / {min(shares):.1%}")
        rows.append([str(b), f"{eager:.2f}", f"{compiled:.2f}", f"{eager / compiled:.2f}x",
                     f"{b / compiled * 1e3:,.0f}", *quality])
    print_table(["batch", f"{base} step ms", "compiled step ms", "speed-up", "compiled decode tok/s",
                 f"{base} = fp32 tokens (mean / worst)", "compiled = fp32 tokens", f"compiled = {base} tokens"], rows)
    print("tokens columns: per sequence, the share of generated positions before the first token that differs")
    print(run_footer(time.perf_counter() - started))


if __name__ == "__main__":
    main()
