"""Lightning-indexer selection on the embedded DSA model: cheaper scoring paths against the float32 reference.

    OMP_NUM_THREADS=1 python benchmarks/indexer_overlap.py                     # 8 passkey prompts of 300-504 tokens
    OMP_NUM_THREADS=1 python benchmarks/indexer_overlap.py --num-prompts 4 --num-new 8

A float32 engine serving ``assets/demo_llm_dsa`` (trained indexer, top-k 64) prefills passkey prompts; the
indexer's inputs of every layer and prefill are captured, and for each way of scoring them the table gives the
fraction of the float32 reference's selected keys that it selects too (:func:`~metainfer_gen.kernels.indexer.
topk_overlap`):

- ``registry path``: what :func:`metainfer_gen.kernels.indexer_topk` runs here (the tiled float32 path on a CPU);
- ``bf16 q/k``: queries and keys rounded to bf16 (a bf16 run caches its keys so);
- ``e4m3 keys, scale 1``: keys as the engine's fp8 KV cache holds them, queries float32;
- ``fp8_index``: DeepSeek-V3.2's scoring, queries and keys in e4m3 with one float32 scale per head vector and per
  key (``kernels.fp8_act_quant``: 1x128 groups, amax / 448), the products taken in float32.

Then the greedy tokens of the engine through the registry path and through the reference path (identical or not).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen import kernels  # noqa: E402
from metainfer_gen.kernels.indexer import INDEXER_TOPK, topk_overlap  # noqa: E402


def dequant_fp8(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) -> the float32 values of its e4m3 form with one scale per row of D (D <= 128: one group)."""
    q, scale = kernels.fp8_act_quant(x.reshape(-1, x.shape[-1]).float())
    return (q.float() * scale.repeat_interleave(128, 1)[:, : x.shape[-1]]).view(x.shape)


VARIANTS = {
    "registry path": lambda q, k: (q, k),
    "bf16 q/k": lambda q, k: (q.bfloat16().float(), k.bfloat16().float()),
    "e4m3 keys, scale 1": lambda q, k: (q, k.to(torch.float8_e4m3fn).float()),
    "fp8_index (DeepSeek)": lambda q, k: (dequant_fp8(q), dequant_fp8(k)),
}


def capture(engine, prompts: list[str]) -> list[tuple]:
    """Run the prompts' prefills; return every layer's indexer call (q, weights, keys, lengths, topk, scale)."""
    from metainfer_gen.llm import SamplingParams
    from metainfer_gen.llm.layers.indexer import Indexer

    calls, select = [], Indexer.select

    def record(self, q, weights, keys, lengths):
        if q.shape[1] > 1:  # prefill rows (decode steps add one query each)
            calls.append((q.clone(), weights.clone(), keys.float().clone(), lengths.clone(), self.topk,
                          self.softmax_scale))
        return select(self, q, weights, keys, lengths)

    Indexer.select = record
    try:
        engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0))
    finally:
        Indexer.select = select
    return calls


def overlaps(calls: list[tuple]) -> dict[str, float]:
    out = {}
    for name, cast in VARIANTS.items():
        shared = total = 0.0
        for q, w, keys, lengths, topk, scale in calls:
            want = INDEXER_TOPK.reference(q, w, keys, lengths, topk, scale)
            q2, k2 = cast(q, keys)
            got = kernels.indexer_topk(q2, w, k2, lengths, topk, scale) if name == "registry path" else \
                INDEXER_TOPK.reference(q2, w, k2, lengths, topk, scale)
            num = int((want >= 0).sum())
            shared += topk_overlap(got, want) * num
            total += num
        out[name] = shared / total
    return out


def greedy_with_reference(engine, prompts: list[str], num_new: int) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens through the registry path, then with every indexer call on the float32 reference."""
    from metainfer_gen.llm import SamplingParams
    from metainfer_gen.llm.layers.indexer import Indexer

    params = SamplingParams(max_new_tokens=num_new, temperature=0, ignore_eos=True)
    fast = [o.token_ids for o in engine.generate(prompts, params)]
    select = Indexer.select
    Indexer.select = lambda self, q, w, k, lengths: INDEXER_TOPK.reference(q, w, k, lengths.long(), self.topk,
                                                                            self.softmax_scale)
    try:
        reference = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        Indexer.select = select
    return fast, reference


def main(argv: list[str] | None = None) -> int:
    from metainfer_gen.llm import EngineConfig, LLMEngine
    from demo_models.llm import configs
    from demo_models.llm.data import prose_sentences
    from demo_models.llm.evaluate import fit_passkey
    from demo_models.llm.indexer_warmup import ASSET_DIR

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8, help="passkey prompts of 300-504 tokens")
    parser.add_argument("--num-new", type=int, default=16, help="greedy tokens compared per prompt")
    args = parser.parse_args(argv)
    engine = LLMEngine.from_pretrained(ASSET_DIR, EngineConfig(dtype="float32", max_model_len=configs.CONTEXT,
                                                               block_size=64, enable_prefix_caching=False))
    rng, sentences = random.Random(77), prose_sentences()
    sizes = [300 + (configs.CONTEXT - 300) * i // max(args.num_prompts - 1, 1) for i in range(args.num_prompts)]
    prompts = [fit_passkey(rng, engine.tokenizer, sentences, n).prompt for n in sizes]
    with torch.inference_mode():
        calls = capture(engine, prompts)
        table = overlaps(calls)
        fast, reference = greedy_with_reference(engine, prompts, args.num_new)
    num_keys = sum(int((c[3]).clamp(max=c[4]).sum()) for c in calls)
    print(f"indexer selection vs the float32 reference on {ASSET_DIR.name}: {len(prompts)} prompts, {len(calls)} "
          f"indexer calls (layers x prefill chunks), {num_keys} selected keys")
    for name, value in table.items():
        print(f"  {name:<24} overlap {value:.4f}")
    same = sum(a == b for f, r in zip(fast, reference) for a, b in zip(f, r))
    print(f"greedy tokens, registry path vs reference path: {same}/{sum(map(len, reference))} identical")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
