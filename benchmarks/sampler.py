"""Sampler step time at R rows of a V-token vocabulary (float32 logits): the batched sampler
(:mod:`metainfer_gen.llm.sampler`) per setting, each with its ratio to greedy, and the old per-row sampler
(:mod:`metainfer_gen.llm.sampler_reference`) beside it, all in one run.

    OMP_NUM_THREADS=1 python benchmarks/sampler.py                  # 64 rows x 129,280 tokens (DeepSeek-V3)
    OMP_NUM_THREADS=1 python benchmarks/sampler.py --quick          # fewer repeats, no per-row top-p row

Logits: ``N(0, 1) * scale`` per row, fresh each repeat. ``--scale 4`` (default) is a peaked distribution, as a
language model's next-token distribution is (the top 64 tokens hold most of the mass); ``--scale 1`` is nearly
flat over the vocabulary, the hard case for top-p (the nucleus is then most of the vocabulary, and rows need
rejection rounds). Settings alternate within each repeat and the median is reported, so load on a shared machine
hits every row; the machine, threads and load average are printed with the table. "greedy" is the sampler's own
greedy path (argmax plus the check that each row's logits are finite); a bare ``argmax`` is the last row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen.llm.sampler import Sampler  # noqa: E402
from metainfer_gen.llm.sampler_reference import sample_reference  # noqa: E402
from metainfer_gen.llm.sequence import SamplingParams  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402  (benchmarks/ is on the path)

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top-k 50": SamplingParams(temperature=0.7, top_k=50),
    "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top-k 50 + top-p 0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="rows (sequences) sampled per step")
    parser.add_argument("--vocab", type=int, default=129_280, help="vocabulary size (DeepSeek-V3: 129,280)")
    parser.add_argument("--scale", type=float, default=4.0, help="logits are N(0, 1) * scale")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per setting (median reported)")
    parser.add_argument("--quick", action="store_true", help="5 repeats; the per-row sampler only for temperature")
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else args.repeats
    started = time.perf_counter()
    print(run_header())
    print(f"rows {args.rows}, vocabulary {args.vocab:,}, logits N(0, 1) * {args.scale:g} float32, "
          f"median of {repeats} repeats\n")
    generators = [torch.Generator().manual_seed(i) for i in range(args.rows)]
    sampler = Sampler()  # as the engine's runner holds one: its scratch buffer lives across steps
    cases = [(name, p, sampler) for name, p in SETTINGS.items()]
    per_row = ["temperature 0.7"] if args.quick else ["temperature 0.7", "top-p 0.9"]
    cases += [(f"{name} (old per-row)", SETTINGS[name], sample_reference) for name in per_row]
    cases.append(("bare argmax (no finite check)", None, lambda logits, *_: logits.argmax(-1)))
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    g = torch.Generator().manual_seed(0)
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        logits = torch.randn(args.rows, args.vocab, generator=g) * args.scale
        for name, params, fn in cases:
            start = time.perf_counter()
            fn(logits, [params] * args.rows, generators)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t[1:]) for name, t in times.items()}
    greedy = median["greedy"]
    print_table(["setting", "ms / step", "x greedy"],
                [[name, f"{median[name] * 1e3:.1f}", f"{median[name] / greedy:.2f}"] for name, _, _ in cases])
    print(run_footer(time.perf_counter() - started))


if __name__ == "__main__":
    main()
