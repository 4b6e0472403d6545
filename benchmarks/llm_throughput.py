"""LLM serving benchmark: our engine vs transformers ``generate`` (batched, left-padded) on the same prompts.

    OMP_NUM_THREADS=2 python benchmarks/llm_throughput.py              # embedded LLM + a larger random DeepSeek-V3
    python benchmarks/llm_throughput.py --models random-glm5 --concurrency 1,16   # a random GLM-5 (glm_moe_dsa)
    python benchmarks/llm_throughput.py --models random-v4 --concurrency 1,16 --no-prefix-cache   # DeepSeek-V4
    python benchmarks/llm_throughput.py --quick                        # small shapes (smoke run)
    python benchmarks/llm_throughput.py --models embedded --concurrency 64 --no-prefix-cache   # one row pair

For each model and each concurrency C (requests arriving together; prompts of mixed lengths, fixed output
length so both sides do the same work), one table row per implementation: input tokens/s and output tokens/s
(tokens / wall seconds of the whole batch), TTFT p50/p95 (arrival to first token; for transformers, every request
of a batch gets its first token after the batch's prefill), and total-throughput ratio ours / transformers. Greedy
outputs are compared (identical-token share), so a speedup that changed the answer is visible. Then the prefix
cache: TTFT of a request with a shared 1,024-token prefix, cold (first) vs warm (prefix cached).

DeepSeek-V4 (``random-v4``, the shape of ``benchmarks/v4_reference.py``): transformers runs the requests one at a
time (its compressed caches would fold left padding into their entries, so a padded batch is not the same
computation); they still arrive together, so a request's TTFT includes the requests run before it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from table import print_table  # noqa: E402  (benchmarks/ is on the path when a script here runs)
from v4_reference import SHAPE as V4  # noqa: E402  (every V4 layer type, hash-routed first layer)

LARGE = dict(vocab_size=4096, hidden_size=384, intermediate_size=1024, moe_intermediate_size=192, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=16,
             num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=128,
             q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
             max_position_embeddings=4096, num_mtp_layers=0)
# GLM-5's layout at LARGE's widths: DSA indexer (top-k 64 < the prompts), full/shared indexer layers, its
# qk_nope != v head widths, MLP types per layer. GLM-5's 32 indexer heads: with few heads a key whose every head
# scores <= 0 ties at exactly 0, and a top-k boundary on such a tie breaks differently in prefill and decode (in
# transformers as here).
GLM5 = {**{k: v for k, v in LARGE.items() if k not in ("num_mtp_layers", "first_k_dense_replace")},
        "qk_nope_head_dim": 48, "v_head_dim": 64, "index_topk": 64, "index_head_dim": 32, "index_n_heads": 32,
        "indexer_types": ["full", "full", "shared", "full", "shared", "shared"],
        "mlp_layer_types": ["dense"] + ["sparse"] * 5}
RANDOM_MODELS = {"random-large": ("deepseek_v3", LARGE), "random-glm5": ("glm_moe_dsa", GLM5),
                 "random-v4": ("deepseek_v4", V4)}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def make_prompts(num: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


class FirstTokenTimer:
    """A transformers streamer that records when the first generated tokens arrive (after the prefill)."""

    def __init__(self):
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first_token_time is None:  # call 1 is the prompt
            self.first_token_time = time.perf_counter()

    def end(self):
        pass


def run_transformers(model, prompts: list[list[int]], new_tokens: int, pad_id: int):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    timer = FirstTokenTimer()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=None, streamer=timer)
    seconds = time.perf_counter() - start
    ttft = [timer.first_token_time - start] * len(prompts)
    return seconds, ttft, [row[width:].tolist() for row in out]


def run_transformers_one_at_a_time(model, prompts: list[list[int]], new_tokens: int, pad_id: int):
    """:func:`run_transformers` on each prompt alone, in turn; TTFT from the start of the first."""
    start, ttft, tokens = time.perf_counter(), [], []
    for prompt in prompts:
        offset = time.perf_counter() - start
        _, first, out = run_transformers(model, [prompt], new_tokens, pad_id)
        ttft.append(offset + first[0])
        tokens += out
    return time.perf_counter() - start, ttft, tokens


def run_ours(engine: LLMEngine, prompts: list[list[int]], new_tokens: int):
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, [o.ttft for o in outputs], [o.token_ids for o in outputs]


def set_stacked_experts(engine: LLMEngine, enabled: bool) -> None:
    """Routed experts as grouped GEMMs over stacked weights (True, the default) or the per-expert loop."""
    from metainfer_gen.llm.layers.moe import MoE

    for module in engine.model.modules():
        if isinstance(module, MoE) and enabled:
            module.pack_experts()
        elif isinstance(module, MoE):
            module.unpack_experts()


def throughput_rows(name: str, path: Path, concurrencies: list[int], lengths: tuple[int, int], new_tokens: int,
                    engine_config: EngineConfig, expert_loop: bool = False) -> list[list[str]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine.from_pretrained(path, engine_config)
    baseline = run_transformers_one_at_a_time if hf.config.model_type == "deepseek_v4" else run_transformers
    vocab = hf.config.vocab_size
    warm = make_prompts(2, vocab, 8, 16, seed=99)
    run_ours(engine, warm, 2)
    baseline(hf, warm, 2, pad_id=0)
    rows = []
    for c in concurrencies:
        prompts = make_prompts(c, vocab, *lengths, seed=c)
        engine.block_manager.reset_prefix_cache()  # random prompts share nothing, but be explicit: cold cache
        n_in, n_out = sum(map(len, prompts)), c * new_tokens
        results = {"transformers": baseline(hf, prompts, new_tokens, pad_id=0),
                   "ours": run_ours(engine, prompts, new_tokens)}
        if expert_loop:
            engine.block_manager.reset_prefix_cache()
            set_stacked_experts(engine, False)
            results["ours, expert loop"] = run_ours(engine, prompts, new_tokens)
            set_stacked_experts(engine, True)
        base = results["transformers"][0]
        for impl, (seconds, ttft, tokens) in results.items():
            same = sum(a == b for a, b in zip(tokens, results["transformers"][2])) / c
            rows.append([name, str(c), impl, f"{n_in / seconds:,.0f}", f"{n_out / seconds:,.1f}",
                         f"{percentile(ttft, 0.5) * 1e3:,.0f}", f"{percentile(ttft, 0.95) * 1e3:,.0f}",
                         f"{base / seconds:.2f}x", f"{same:.0%}" if impl != "transformers" else "-"])
    return rows


def prefix_cache_rows(path: Path, prefix_len: int, engine_config: EngineConfig, repeats: int) -> list[list[str]]:
    engine = LLMEngine.from_pretrained(path, engine_config)
    vocab = engine.model.config.vocab_size
    prefix = make_prompts(1, vocab, prefix_len, prefix_len, seed=7)[0]
    tails = make_prompts(repeats + 1, vocab, 16, 16, seed=8)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    run_ours(engine, make_prompts(1, vocab, 8, 8, seed=9), 1)  # warm-up
    cold = engine.generate([prefix + tails[0]], params)[0]
    warm = [engine.generate([prefix + t], params)[0] for t in tails[1:]]
    warm_ttft = statistics.median(o.ttft for o in warm)
    return [[f"{prefix_len}+16", "cold", f"{cold.ttft * 1e3:,.1f}", str(cold.num_cached_tokens), "1.00x"],
            [f"{prefix_len}+16", "warm (median)", f"{warm_ttft * 1e3:,.1f}", str(warm[0].num_cached_tokens),
             f"{cold.ttft / warm_ttft:.1f}x"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and counts (smoke run)")
    parser.add_argument("--model", default=None, help="checkpoint to use instead of the embedded LLM")
    parser.add_argument("--new-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--models", default="embedded,random-large",
                        help="comma-separated subset of embedded,random-large,random-glm5,random-v4 (throughput rows)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated request counts (default 1,16,64; --quick 1,4)")
    parser.add_argument("--no-prefix-cache", action="store_true", help="skip the prefix-cache TTFT table")
    parser.add_argument("--expert-loop", action="store_true",
                        help="add a row: our engine with the routed experts in the per-expert loop (the path "
                             "before grouped experts), same prompts, same run")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    if not set(names) <= {"embedded", *RANDOM_MODELS}:
        parser.error(f"--models takes embedded, {', '.join(RANDOM_MODELS)}; got {args.models!r}")
    from transformers import AutoConfig, AutoModelForCausalLM

    from metainfer_gen.pipelines.text_generation import default_llm_dir

    torch.manual_seed(0)
    concurrencies = [int(c) for c in args.concurrency.split(",")] if args.concurrency else \
        ([1, 4] if args.quick else [1, 16, 64])
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    new_tokens = 4 if args.quick else args.new_tokens
    tmp = Path(tempfile.mkdtemp(prefix="llm_bench_"))
    quick = dict(hidden_size=128, vocab_size=512) if args.quick else {}
    for name, (model_type, shape) in RANDOM_MODELS.items():
        if name in names or (name == "random-large" and not args.no_prefix_cache):
            config = AutoConfig.for_model(model_type, bos_token_id=None, eos_token_id=None, **{**shape, **quick})
            AutoModelForCausalLM.from_config(config).save_pretrained(tmp / name)
    models = [("embedded", Path(args.model) if args.model else default_llm_dir(), (32, 256)),
              *((name, tmp / name, (64, 512)) for name in RANDOM_MODELS)]
    models = [m for m in models if m[0] in names]
    engine_config = EngineConfig(block_size=16, max_num_seqs=64, max_num_batched_tokens=2048)
    rows = []
    for name, path, lengths in models:
        if args.quick:
            lengths = (8, 32)
        rows += throughput_rows(name, path, concurrencies, lengths, new_tokens, engine_config, args.expert_loop)
    print(f"threads={torch.get_num_threads()}, output tokens per request={new_tokens}, prompts uniform in the "
          f"given range; ratio = transformers seconds / ours; load average before: {load}, after: "
          + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print_table(["model", "C", "impl", "input tok/s", "output tok/s", "TTFT p50 ms", "TTFT p95 ms",
                 "total vs HF", "same tokens"], rows)
    if args.no_prefix_cache:
        return
    prefix_len = 128 if args.quick else 1024
    print()
    print_table(["prompt", "prefix cache", "TTFT ms", "cached tokens", "speedup"],
                prefix_cache_rows(tmp / "random-large", prefix_len, engine_config, repeats=3 if args.quick else 5))


if __name__ == "__main__":
    main()
