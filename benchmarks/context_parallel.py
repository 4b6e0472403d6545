"""Long-prompt prefill with context parallelism: CP=2 (two CPU ranks, gloo ring) vs CP=1, same code and model.

    OMP_NUM_THREADS=1 python benchmarks/context_parallel.py                      # 16K-token prompt, MLA model
    OMP_NUM_THREADS=1 python benchmarks/context_parallel.py --tokens 4096 --model dsa   # DeepSeek-V3.2 top-k

Prints prefill tokens/s for CP=1 and CP=2 (the faster of ``--repeats`` prefills per rank; the first one's time
beside it), the ratio, each rank's share of the prompt, whether the greedy tokens
after the prefill (decoded from the paged decode layout) are equal, and the machine's load average before and
after. Both runs use the tiled attention of ``metainfer_gen.llm.context_parallel``: PyTorch's fused CPU flash
kernel per (query tile, ring block) with a log-sum-exp merge for MLA, the running top-k and sparse gather for
DSA (the engine's one-pass prefill would materialise heads x 16K x 16K float32 scores). Models: the tiny random
DeepSeek-V3 of the tests ("mla", 3 layers, 4 heads) or its V3.2 variant ("dsa", index_topk 8). Each rank is one
process with one thread: on a machine with fewer free cores than ranks, CP=2 competes with itself and shows no
speedup, so read the load average with the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="prompt length (default 16384)")
    parser.add_argument("--model", choices=("mla", "dsa"), default="mla",
                        help="tiny DeepSeek-V3 (mla, default) or DeepSeek-V3.2 with top-k attention (dsa)")
    parser.add_argument("--new-tokens", type=int, default=4, help="greedy tokens decoded after (default 4)")
    parser.add_argument("--tile", type=int, default=1024, help="queries per score tile (default 1024)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="prefills per rank; the fastest counts (the first pays page faults: 7.7 vs 4.6 s at "
                             "16K on one rank). Default 2")
    args = parser.parse_args()

    import torch
    from tests.collectives.harness import run_ranks
    from tests.llm.checkpoints import make_hf_model, random_prompts
    from tests.llm.dsa_checkpoints import make_hf_v32_model

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        (make_hf_model("moe") if args.model == "mla" else make_hf_v32_model()).save_pretrained(path)  # rotary
        prompt = random_prompts(1, 160, (args.tokens,), seed=0)[0]  # tables are sized by the worker
        kw = dict(path=str(path), prompt=prompt, max_new_tokens=args.new_tokens, tile=args.tile,
                  repeats=args.repeats)
        rows = {}
        for world in (1, 2):
            out = run_ranks("tests.llm.cp_workers:cp_prefill_decode", Path(tmp), world=world, timeout_s=3000, **kw)
            rows[world] = (max(o["seconds"] for o in out.values()), [o["shard"] for o in out.values()],
                           out[0]["tokens"], max(o["first_seconds"] for o in out.values()))
    base = rows[1][0]
    print(f"prefill of {args.tokens} tokens, tiny random {'DeepSeek-V3' if args.model == 'mla' else 'DeepSeek-V3.2'} "
          f"({args.model}), float32, {torch.get_num_threads()} thread(s) per rank, {os.cpu_count()} CPUs, load "
          f"average {load_before[0]:.1f} before and {os.getloadavg()[0]:.1f} after")
    print("| CP | seconds | prefill tokens/s | vs CP=1 | first prefill s | tokens per rank | "
          "greedy tokens equal CP=1 |")
    print("|---|---|---|---|---|---|---|")
    for world, (sec, shards, tokens, first) in rows.items():
        print(f"| {world} | {sec:.2f} | {args.tokens / sec:.0f} | {base / sec:.2f}x | {first:.2f} | {shards} | "
              f"{tokens == rows[1][2]} |")


if __name__ == "__main__":
    main()
