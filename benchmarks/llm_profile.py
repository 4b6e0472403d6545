"""Where one offline batch of the engine spends its time: ``torch.profiler`` over ``LLMEngine.generate``.

    OMP_NUM_THREADS=1 python benchmarks/llm_profile.py                  # serve_llm.py's random-large, 64 prompts
    OMP_NUM_THREADS=1 python benchmarks/llm_profile.py --num-prompts 16 --rows 40

The model is serve_llm.py's random-large DeepSeek-V3 (576-wide latent), saved once under ``--workdir``; prompts are
random token ids of 64-512 tokens with 32 greedy output tokens (``ignore_eos``), as that benchmark's C=64 batch. The
engine is warmed up and runs one unprofiled batch first, so the profiled batch pays no compile. Runs under the host
allocator ``metainfer-gen serve`` uses (:func:`metainfer_gen.host_allocator.reexec`). Prints the run's header, the
unprofiled and profiled batch seconds and the ops by self CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import add_batch_args, random_large_batches  # noqa: E402
from table import run_header  # noqa: E402

from metainfer_gen import host_allocator  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_args(parser)
    parser.add_argument("--rows", type=int, default=15, help="ops printed (default 15)")
    args = parser.parse_args(argv)
    if argv is None:  # under the host allocator `metainfer-gen serve` runs with (tcmalloc where installed)
        host_allocator.reexec()
    print(run_header())
    pipe, params, batches = random_large_batches(args, 3)
    print(f"dtype {pipe.engine.dtype}")
    pipe.engine.generate(batches[0], params)  # the first batch of a process, kept out of both figures
    start = time.perf_counter()
    pipe.engine.generate(batches[1], params)
    print(f"batch of {args.num_prompts}: {time.perf_counter() - start:.2f} s (unprofiled), "
          f"threads {torch.get_num_threads()}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        pipe.engine.generate(batches[2], params)
        print(f"profiled: {time.perf_counter() - start:.2f} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    ops = decode_step_ops(pipe.engine, batches[0][:args.num_prompts], params)
    layers = len(pipe.engine.model.model.layers)
    print(f"aten ops in one decode step of {args.num_prompts} sequences: {ops} ({ops / layers:.0f} per layer, "
          f"{layers} layers; top-level ops, their callees not counted)")


def decode_step_ops(engine, prompts, params) -> int:
    """Top-level aten ops (their callees not counted) of the first decode-only step of ``len(prompts)`` sequences
    in a ``generate`` over ``prompts``."""
    run, counted = engine.runner.run, []

    def counting_run(out):
        if counted or not out.scheduled or any(item.num_tokens != 1 for item in out.scheduled):
            return run(out)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            sampled = run(out)
        counted.append(sum(1 for e in prof.events() if e.name.startswith("aten::")
                           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))))
        return sampled

    engine.runner.run = counting_run
    try:
        engine.generate(prompts, params)
    finally:
        engine.runner.run = run
    if not counted:
        raise RuntimeError("no decode-only step: raise --output-len")
    return counted[0]


if __name__ == "__main__":
    main()
