"""DeepSeek-V4: our one-sequence reference path against transformers ``generate`` on the same random model.

    OMP_NUM_THREADS=1 python benchmarks/v4_reference.py            # 8 prompts of 64-512 tokens x 32 new tokens
    python benchmarks/v4_reference.py --quick                      # 2 prompts, smoke run

The engine runs V4 too (``benchmarks/llm_throughput.py --models random-v4``); this times the reference path, which
runs one request at a time (prefill, then one decode step per token), so the only fair comparison is transformers
one request at a time too. Rows: input and
output tokens/s over all requests (tokens / wall seconds), TTFT p50, ratio ours / transformers, and the share of
requests whose greedy tokens are identical. The model: every V4 layer type (sliding, CSA, HCA), hash-routed first
layer, V4's 128-token window and 4x / 128x rates at a small width.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from table import print_table  # noqa: E402  (benchmarks/ is on the path when a script here runs)

SHAPE = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=8, head_dim=64,
             q_lora_rank=128, o_lora_rank=64, o_groups=4, hc_mult=4, index_topk=64, index_head_dim=32,
             index_n_heads=8, intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4, sliding_window=128,
             max_position_embeddings=4096,
             layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * 2,
             mlp_layer_types=["hash_moe"] + ["moe"] * 5)


def _time(fn) -> tuple[float, list[int]]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 short prompts (smoke run)")
    parser.add_argument("--new-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--requests", type=int, default=8, help="prompts, run one at a time on each side")
    args = parser.parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM

    from metainfer_gen.llm.models.deepseek_v4 import DeepseekV4Reference

    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v4", bos_token_id=None, eos_token_id=None, **SHAPE)
    hf = AutoModelForCausalLM.from_config(config).eval()
    ours = DeepseekV4Reference.from_hf(hf, SHAPE["max_position_embeddings"])
    num, new = (2, 4) if args.quick else (args.requests, args.new_tokens)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16 if args.quick else 64, 64 if args.quick else 513, (num,), generator=g).tolist()
    prompts = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())

    def hf_run(prompt, max_new):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        return out[0, len(prompt):].tolist()

    hf_run(prompts[0][:8], 2), ours.greedy(prompts[0][:8], 2)  # warm-up
    results = {}
    for name, run in (("transformers", hf_run), ("ours (reference path)", ours.greedy)):
        seconds, ttft, tokens = 0.0, [], []
        for prompt in prompts:
            first, _ = _time(lambda: run(prompt, 1))
            total, out = _time(lambda: run(prompt, new))
            seconds, ttft, tokens = seconds + total, ttft + [first], tokens + [out]
        results[name] = (seconds, ttft, tokens)
    base, n_in = results["transformers"][0], sum(lengths)
    rows = [[name, f"{n_in / s:,.0f}", f"{num * new / s:,.1f}", f"{statistics.median(t) * 1e3:,.0f}",
             f"{base / s:.2f}x", "-" if name == "transformers" else
             f"{sum(a == b for a, b in zip(tok, results['transformers'][2])) / num:.0%}"]
            for name, (s, t, tok) in results.items()]
    print(f"threads={torch.get_num_threads()}, {num} requests one at a time, prompts {min(lengths)}-{max(lengths)} "
          f"tokens, {new} new tokens each, float32; TTFT = a 1-token run; load average before: {load}, after: "
          + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print_table(["impl", "input tok/s", "output tok/s", "TTFT p50 ms", "total vs HF", "same tokens"], rows)


if __name__ == "__main__":
    main()
