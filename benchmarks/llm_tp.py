"""Tensor-parallel engine throughput: TP=2 (torchrun, 2 CPU ranks) vs TP=1 on the same random DeepSeek-V3.

    OMP_NUM_THREADS=1 python benchmarks/llm_tp.py            # builds the checkpoint, runs TP=1, then torchrun TP=2
    OMP_NUM_THREADS=1 python benchmarks/llm_tp.py --quick    # smaller model and batch

One table, three rows (TP=1; TP=2 with our collectives; TP=2 with every collective sent to gloo): tokens/s (prompt +
generated tokens over the wall time of the whole batch), the seconds rank 0 spent inside collectives (all-reduce /
all-gather calls, timed around each call) and their share, the number of calls, the paths the audit recorded, and
whether the greedy tokens equal TP=1's. On a 2-core machine shared with other work the TP=2 run competes with itself for
cores, so expect it to be slower there; the point of the row is the collective share and the token equality.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_throughput import LARGE  # noqa: E402  (the same larger random DeepSeek-V3, fewer layers)

MODEL = {**LARGE, "num_hidden_layers": 4, "max_position_embeddings": 1024}
QUICK = {**MODEL, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2,
         "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}


def build_checkpoint(path: Path, shape: dict) -> None:
    """Save a seeded random DeepSeek-V3 of ``shape`` with transformers' ``save_pretrained``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v3", bos_token_id=None, eos_token_id=None, **shape)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def run(path: str, prompts: list, max_new: int, tp: int, backend_only: bool = False) -> dict:
    """Generate greedily with ``tp`` ranks (this process is one of them); time the collectives on this rank.

    ``backend_only`` sends every collective to gloo (the group is passed without its shared-memory communicator),
    the baseline for the same engine."""
    import dataclasses

    import torch

    from metainfer_gen import collectives, kernels
    from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(1)
    spent = {"seconds": 0.0, "calls": 0}
    if tp > 1:
        for name in ("all_reduce", "all_gather"):
            inner = getattr(collectives, name)

            def timed(*args, _inner=inner, **kwargs):
                if backend_only:
                    handle = collectives.get_state().groups["tp"]
                    kwargs["group"] = dataclasses.replace(handle, comm=None, comm_refusal="benchmark: gloo forced")
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    spent["seconds"] += time.perf_counter() - start
                    spent["calls"] += 1

            setattr(collectives, name, timed)  # the engine's layers look these up at call time
    engine = LLMEngine.from_pretrained(path, EngineConfig(tensor_parallel_size=tp, block_size=16,
                                                          max_num_batched_tokens=512))
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    spent.update(seconds=0.0, calls=0)
    start = time.perf_counter()
    with kernels.audit() as report:
        outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    paths = {op: sorted(p) for op, p in report.paths().items() if op in ("all_reduce", "all_gather")}
    if tp > 1:
        collectives.shutdown_distributed()
    tokens = sum(len(p) for p in prompts) + sum(len(o.token_ids) for o in outputs)
    return {"tp": tp, "backend_only": backend_only, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "collective_s": spent["seconds"], "collective_calls": spent["calls"], "paths": paths,
            "token_ids": [o.token_ids for o in outputs]}


def main(argv: list[str] | None = None) -> None:
    """Build the checkpoint, run TP=1 here and TP=2 under torchrun, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller model and batch")
    parser.add_argument("--num-prompts", type=int, default=8, help="requests in the batch")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="generated tokens per request")
    parser.add_argument("--worker", nargs=3, metavar=("CHECKPOINT", "SPEC_JSON", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # a torchrun rank
        spec = json.loads(Path(args.worker[1]).read_text())
        backend_only = args.worker[2] == "gloo"
        result = run(args.worker[0], spec["prompts"], spec["max_new"], int(os.environ["WORLD_SIZE"]), backend_only)
        if os.environ.get("RANK") == "0":
            Path(spec["out"] + args.worker[2]).write_text(json.dumps(result))
        return
    import torch

    shape = QUICK if args.quick else MODEL
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, shape["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(16, 128, (args.num_prompts,), generator=g)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        build_checkpoint(ckpt, shape)
        tp1 = run(str(ckpt), prompts, args.max_new_tokens, 1)
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "tp2.json"
        spec.write_text(json.dumps({"prompts": prompts, "max_new": args.max_new_tokens, "out": str(out)}))
        from metainfer_gen.collectives.distributed import free_port

        rows = [tp1]
        for mode in ("ours", "gloo"):
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                            str(free_port()), __file__, "--worker", str(ckpt), str(spec), mode], check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows.append(json.loads(Path(str(out) + mode).read_text()))
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"engine, random DeepSeek-V3 (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
          f"{shape['n_routed_experts']} experts), {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
          f"float32, CPU ({os.cpu_count()} cores, load average {load})")
    print("| TP | collectives | seconds | tokens/s | ratio vs TP=1 | collectives s (share) | collective calls | "
          "paths | tokens equal TP=1 |")
    print("|---:|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        share = f"{r['collective_s']:.3f} ({r['collective_s'] / r['seconds']:.0%})" if r["tp"] > 1 else "-"
        paths = "; ".join(f"{op}: {', '.join(p)}" for op, p in r["paths"].items()) or "-"
        kind = "-" if r["tp"] == 1 else "gloo" if r["backend_only"] else "ours"
        print(f"| {r['tp']} | {kind} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / tp1['tokens_per_s']:.2f}x | {share} | {r['collective_calls'] or '-'} | {paths} | "
              f"{r['token_ids'] == tp1['token_ids']} |")


if __name__ == "__main__":
    main()
