"""Prefill attention: the ``block_attention`` op's paths at MLA prefill shapes, then the engine's prefill-heavy batch
with each path forced, one table each, from one run.

    OMP_NUM_THREADS=1 python benchmarks/prefill_attention.py            # about 3 minutes
    OMP_NUM_THREADS=1 python benchmarks/prefill_attention.py --quick    # smaller shapes, one engine round

Op rows: queries (8 heads, t, 128) over keys (8, s, 128) and values (8, s, 64), the random DeepSeek-V3's expanded
prefill (qk_nope 64 + rope 64, v 64); each path called directly, paths interleaved per round, the median of
``--repeats`` rounds; error = |out - the float32 whole-matrix reference| on the same inputs (mean and max), with
queries scaled by 1 (flat attention) and 3 (peaked). Engine rows: serve_llm.py's random-large checkpoint (built under
``--workdir`` on first use), 16 prompts of 512-1,024 random tokens x 4 greedy tokens, ``LLMEngine.generate`` with
the op's other paths switched off, in bf16, prefix caching off (each batch prefills every prompt), the paths
taking turns; tokens compared between the paths.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import random_large_pipeline, random_prompts  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402

from metainfer_gen.kernels import block_attention as ba  # noqa: E402
from metainfer_gen.llm.sequence import SamplingParams  # noqa: E402

SHAPES = [(768, 768, True), (1024, 640, True), (256, 640, False), (64, 640, False)]  # (queries, keys, causal)


@contextlib.contextmanager
def only(path: str):
    """Dispatch of ``block_attention`` runs ``path`` (its other implementations unregistered for the block)."""
    saved = list(ba.BLOCK_ATTENTION._impls)
    ba.BLOCK_ATTENTION._impls[:] = [i for i in saved if i.name == path]
    ba.BLOCK_ATTENTION.clear_decisions()
    try:
        yield
    finally:
        ba.BLOCK_ATTENTION._impls[:] = saved
        ba.BLOCK_ATTENTION.clear_decisions()


def _time(fn, calls: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def op_rows(repeats: int, quick: bool) -> list[list[str]]:
    rows = []
    paths = ["flash-cpu", "bmm-blocks", "torch"]
    for t, s, causal in SHAPES[:2] if quick else SHAPES:
        for qscale in (1.0, 3.0):
            torch.manual_seed(0)
            q = (torch.randn(8, t, 128) * qscale).bfloat16()
            k, v = torch.randn(8, s, 128).bfloat16(), torch.randn(8, s, 64).bfloat16()
            scale = 128 ** -0.5
            ref, _ = ba.block_attention_reference(q.float(), k.float(), v.float(), scale, causal=causal)
            fns = {p: (lambda p=p: ba.BLOCK_ATTENTION.implementation(p).fn(q, k, v, scale, None, causal))
                   for p in paths}
            times = {p: [] for p in paths}
            with torch.inference_mode():
                for fn in fns.values():
                    fn()
                for _ in range(repeats):
                    for p, fn in fns.items():
                        times[p].append(_time(fn))
                for p in paths:
                    err = (fns[p]()[0].float() - ref).abs()
                    ms = statistics.median(times[p]) * 1e3
                    base = statistics.median(times["flash-cpu"]) * 1e3
                    rows.append([f"{t} x {s}{' causal' if causal else ''}", f"{qscale:g}", p, f"{ms:.2f}",
                                 f"{base / ms:.2f}x", f"{err.mean():.1e} / {err.max():.1e}"])
    return rows


def engine_rows(workdir: str, rounds: int, quick: bool) -> list[list[str]]:
    num = 4 if quick else 16
    pipe, lo, hi = random_large_pipeline(workdir, num, "128,256" if quick else "512,1024", 4, "bfloat16",
                                         enable_prefix_caching=False)  # each batch prefills its whole prompts
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(num, 1000, lo, hi, 7)
    tokens_in = sum(len(p) for p in prompts)
    seconds, outputs = {"flash-cpu": [], "bmm-blocks": []}, {}
    for path in seconds:  # one batch per path first: no compile or first-call cost in the rows
        with only(path):
            pipe.engine.generate(prompts, params)
    for _ in range(rounds):
        for path in seconds:
            with only(path):
                start = time.perf_counter()
                out = pipe.engine.generate(prompts, params)
                seconds[path].append(time.perf_counter() - start)
            outputs[path] = [o.token_ids for o in out]
    same = sum(a == b for a, b in zip(outputs["flash-cpu"], outputs["bmm-blocks"]))
    rows = []
    for path, values in seconds.items():
        best = min(values)
        rows.append([path, f"{best:.2f}", f"{tokens_in / best:,.0f}", f"{min(seconds['flash-cpu']) / best:.2f}x",
                     f"{same}/{num}" if path == "bmm-blocks" else "-"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/llm_profile", help="where the random checkpoint is saved")
    parser.add_argument("--repeats", type=int, default=7, help="op rounds (default 7)")
    parser.add_argument("--rounds", type=int, default=2, help="engine batches per path (default 2)")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, one engine round")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print(run_header())
    print("block_attention paths, bf16, 8 heads, qk 128, v 64 (ms: median; vs flash-cpu: its time / the path's)")
    print_table(["queries x keys", "q scale", "path", "ms", "vs flash-cpu", "error mean / max"],
                op_rows(2 if args.quick else args.repeats, args.quick))
    print("\nengine prefill-heavy batch, bf16 (seconds: the fastest of the rounds; tokens = the other path's)")
    print_table(["block_attention path", "batch s", "input tok/s", "vs flash-cpu", "tokens equal"],
                engine_rows(args.workdir, 1 if args.quick else args.rounds, args.quick))
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
