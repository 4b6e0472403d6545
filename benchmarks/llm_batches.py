"""Seconds per offline batch of the engine, batch after batch, optionally from another checkout (an A/B of commits).

    OMP_NUM_THREADS=2 python benchmarks/llm_batches.py --dtype bfloat16 --prompt-lens 512,1024 --output-len 4
    git worktree add /tmp/old c578a0c
    OMP_NUM_THREADS=2 python benchmarks/llm_batches.py --checkout /tmp/old --dtype bfloat16      # the same, old code

The model is serve_llm.py's random DeepSeek-V3 (576-wide latent), saved once under ``--workdir``; each batch is
``--num-prompts`` fresh random prompts (seeds 1, 2, ...) with greedy ``--output-len`` tokens (``ignore_eos``), after
the engine's warm-up. Prints one line: the checkout, dtype, shapes and the seconds of every batch (the first batch
of a process pays what the warm-up did not cover). Runs under the host allocator ``metainfer-gen serve`` uses
(:func:`metainfer_gen.host_allocator.reexec`). Run the sides one after the other with nothing else running.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(HERE))
    from serve_models import add_batch_args, random_large_batches

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", default=str(HERE.parent), help="the checkout whose metainfer_gen runs "
                        "(default: this one)")
    add_batch_args(parser, prompt_lens="512,1024", output_len=4, dtype="bfloat16")
    parser.add_argument("--batches", type=int, default=3, help="batches in a row (default 3)")
    args = parser.parse_args(argv)
    if argv is None:  # under the host allocator `metainfer-gen serve` runs with (tcmalloc where installed)
        sys.path.insert(0, str(HERE.parent))
        from metainfer_gen import host_allocator

        host_allocator.reexec()
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE.parent]  # serve_models adds this checkout
    sys.path.insert(0, str(Path(args.checkout).resolve()))
    for name in [m for m in sys.modules if m == "metainfer_gen" or m.startswith("metainfer_gen.")]:
        del sys.modules[name]
    import metainfer_gen

    pipe, params, batches = random_large_batches(args, args.batches)
    seconds = []
    for prompts in batches:
        start = time.perf_counter()
        pipe.engine.generate(prompts, params)
        seconds.append(time.perf_counter() - start)
    tokens = sum(map(len, batches[-1]))
    lengths = args.prompt_lens.replace(",", "-")
    print(f"{Path(metainfer_gen.__file__).parents[1]} {args.dtype} {args.num_prompts} x {lengths} tokens, "
          f"{args.output_len} out: " + " / ".join(f"{s:.2f}" for s in seconds) + " s per batch; last batch "
          f"{tokens / seconds[-1]:,.0f} input tok/s, {args.num_prompts * args.output_len / seconds[-1]:,.0f} "
          f"output tok/s")


if __name__ == "__main__":
    main()
