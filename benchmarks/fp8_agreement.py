"""FP8 block-scaled weights vs bf16 on a checkpoint: greedy-token agreement, weight bytes, and where they disagree.

    OMP_NUM_THREADS=1 python benchmarks/fp8_agreement.py                  # embedded LLM: agreement and bytes
    OMP_NUM_THREADS=1 python benchmarks/fp8_agreement.py --diagnose       # + margins, fp32 arbiter, per-layer errors
    OMP_NUM_THREADS=1 python benchmarks/fp8_agreement.py --num-prose 0    # the 8 fixed prompts only

Agreement (the figure ``docs/demo_llm.md`` reports): the same 8 prompts x 32 greedy tokens on a bf16 engine and on
one with ``quantization="fp8"``. Teacher-forced: at each position of the bf16 continuation, does the fp8 engine's
argmax equal bf16's. Free-running: both generate, compared position by position (one early difference changes the
rest). Bytes: every linear weight, fp8 scales included. ``--num-prose N`` (default 64) repeats the teacher-forced
figure on N prompts cut from the demo model's prose (seeded), and prints the figure over all 8 + N prompts: 256
tokens alone give an interval of about +-3 points, too wide to tell 94% from 95%.

Diagnosis: for every teacher-forced disagreement, the bf16 logit margin (top-1 minus top-2; bf16 logits near 10
are spaced 1/16 apart, so 0 is an exact tie), the fp8 engine's margin for its own pick, and which of the two a
float32 engine picks; the first divergent position of each free-running prompt; the relative output error of each
fp8 layer against its bf16 weight on the same bf16 inputs; and the agreement when only one decoder layer, or only
one family of projections, is in fp8 (the rest bf16).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["the pass key is 4821. remember it. the grass is green. what is the pass key? the pass key is",
           "once upon a time", "The capital of France is", "the quick brown fox", "In the morning the children",
           "The weather today", "She opened the door and", "He said that the"]
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "metainfer_gen" / "assets" / "demo_llm")


def load(model_path: str, dtype: str = "bfloat16", quantization: str | None = None):
    from metainfer_gen.llm import EngineConfig, LLMEngine

    return LLMEngine.from_pretrained(model_path, EngineConfig(dtype=dtype, block_size=16, quantization=quantization))


def prose_prompts(num_prompts: int, seed: int = 0, num_words: int = 6) -> list[str]:
    """The first ``num_words`` words of ``num_prompts`` seeded sentences of the demo model's prose."""
    import random

    from demo_models.llm.data import prose_sentences

    sentences = [s for s in prose_sentences() if len(s.split()) >= num_words + 2]
    return [" ".join(s.split()[:num_words]) for s in random.Random(seed).sample(sentences, num_prompts)]


def greedy(engine, num_new: int, prompts: list[str] = PROMPTS) -> list[list[int]]:
    from metainfer_gen.llm import SamplingParams

    params = SamplingParams(max_new_tokens=num_new, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(prompts, params)]


def forced_logits(engine, sequences: list[list[int]], num_new: int) -> torch.Tensor:
    """(prompts, num_new, vocab) float32 logits predicting the last num_new tokens of each sequence."""
    from metainfer_gen.llm.attention_metadata import AttentionMetadata

    out = []
    for ids in sequences:
        meta = AttentionMetadata.build([0], [len(ids)], [list(range(len(ids) // 16 + 1))], 16)
        with torch.inference_mode():
            hidden = engine.model(torch.tensor(ids), meta, engine.runner.kv_caches)
            out.append(engine.model.compute_logits(hidden).float()[len(ids) - num_new - 1: len(ids) - 1])
    return torch.stack(out)


def agreement(model_path: str = DEFAULT_MODEL, num_new: int = 32, prompts: list[str] = PROMPTS) -> dict:
    """Teacher-forced and free-running greedy agreement of fp8 weights with bf16, and linear-weight bytes."""
    from metainfer_gen.llm.fp8 import weight_bytes

    base, fp8 = load(model_path), load(model_path, quantization="fp8")
    ref, got = greedy(base, num_new, prompts), greedy(fp8, num_new, prompts)
    sequences = [base.encode(text) + r for text, r in zip(prompts, ref)]
    same = forced_logits(base, sequences, num_new).argmax(-1) == forced_logits(fp8, sequences, num_new).argmax(-1)
    free = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    return dict(forced=same.float().mean().item(), num_forced=int(same.sum()), num_tokens=same.numel(),
                free=free / same.numel(), bf16_bytes=weight_bytes(base.model).linear_weight_bytes,
                fp8_bytes=weight_bytes(fp8.model).linear_weight_bytes)


def _interval(agreed: int, total: int) -> float:
    """Half width of the binomial 95% interval of ``agreed / total``."""
    share = agreed / total
    return 1.96 * (share * (1 - share) / total) ** 0.5


def print_agreement(model_path: str = DEFAULT_MODEL, prompts: list[str] = PROMPTS, label: str = "",
                    num_new: int = 32) -> dict:
    a = agreement(model_path, num_new, prompts)
    print(f"FP8 vs bf16 weights on {model_path}{label}: teacher-forced greedy agreement {a['forced']:.1%} "
          f"({a['num_forced']}/{a['num_tokens']}, +- {_interval(a['num_forced'], a['num_tokens']):.1%}), "
          f"free-running {a['free']:.1%}; linear weights {a['bf16_bytes']} -> {a['fp8_bytes']} bytes "
          f"({a['fp8_bytes'] / a['bf16_bytes']:.2f}x, scales included)")
    return a


def _fp8_layers(engine) -> dict[str, torch.nn.Module]:
    from metainfer_gen.llm.layers.linear import LinearBase

    return {name: m for name, m in engine.model.named_modules()
            if isinstance(m, LinearBase) and m.weight.dtype == torch.float8_e4m3fn}


@contextmanager
def fp8_only(fp8, base, keep) -> Iterator[None]:
    """Inside the block, the fp8 engine's layers whose name fails ``keep(name)`` hold their bf16 weights."""
    layers, dense = _fp8_layers(fp8), dict(base.model.named_modules())
    saved = {}
    for name, m in layers.items():
        if not keep(name):
            saved[name] = (m._parameters["weight"], m._buffers.pop("weight_scale_inv"))
            m._parameters["weight"] = dense[name]._parameters["weight"]
    try:
        yield
    finally:
        for name, (weight, scale) in saved.items():
            layers[name]._parameters["weight"] = weight
            layers[name]._buffers["weight_scale_inv"] = scale


def layer_errors(fp8, base, sequences: list[list[int]], num_new: int) -> dict[str, float]:
    """Relative Frobenius error of each fp8 layer's output against the same layer with its bf16 weight, on the
    inputs the fp8 engine feeds it (hooks on the fp8 engine, whose routed experts run one module each)."""
    import torch.nn.functional as F

    layers, dense, sums = _fp8_layers(fp8), dict(base.model.named_modules()), defaultdict(lambda: [0.0, 0.0])

    def hook(name):
        def record(module, args, output):
            want = F.linear(args[0], dense[name].weight).float()
            sums[name][0] += float((output.float() - want).pow(2).sum())
            sums[name][1] += float(want.pow(2).sum())
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in layers.items()]
    try:
        forced_logits(fp8, sequences, num_new)
    finally:
        for h in handles:
            h.remove()
    return {name: (e / max(n, 1e-30)) ** 0.5 for name, (e, n) in sums.items()}


def _family(name: str) -> str:
    return re.sub(r"experts\.\d+\.", "experts.*.", re.sub(r"^model\.layers\.\d+\.", "", name))


def diagnose(model_path: str = DEFAULT_MODEL, num_new: int = 32) -> None:
    base, fp8, f32 = load(model_path), load(model_path, quantization="fp8"), load(model_path, dtype="float32")
    ref, got = greedy(base, num_new), greedy(fp8, num_new)
    sequences = [base.encode(text) + r for text, r in zip(PROMPTS, ref)]
    lb, l8, l32 = (forced_logits(e, sequences, num_new) for e in (base, fp8, f32))
    top2 = lb.topk(2, -1).values
    margin = top2[..., 0] - top2[..., 1]
    pick_b, pick_8, pick_32 = lb.argmax(-1), l8.argmax(-1), l32.argmax(-1)
    total = pick_b.numel()
    print(f"teacher-forced agreement with bf16: fp8 {int((pick_8 == pick_b).sum())}/{total}; float32 "
          f"{int((pick_32 == pick_b).sum())}/{total} (bf16's own rounding); fp8 with float32 "
          f"{int((pick_8 == pick_32).sum())}/{total}")
    print(f"logit RMS difference from bf16: fp8 {float((l8 - lb).pow(2).mean().sqrt()):.3f}, float32 "
          f"{float((l32 - lb).pow(2).mean().sqrt()):.3f}; median bf16 top-1 margin {float(margin.median()):.3f}")
    print("disagreements (prompt, position): bf16 pick and margin | fp8 pick and its margin over bf16's | fp32 pick")
    for p, i in (pick_8 != pick_b).nonzero().tolist():
        b, q = int(pick_b[p, i]), int(pick_8[p, i])
        arbiter = "bf16" if pick_32[p, i] == b else "fp8" if pick_32[p, i] == q else "neither"
        print(f"  ({p}, {i:2d}): bf16 {b:3d} by {float(margin[p, i]):.4f} | fp8 {q:3d} by "
              f"{float(l8[p, i, q] - l8[p, i, b]):.4f} | fp32 sides with {arbiter}")
    first = [next((i for i, (a, c) in enumerate(zip(r, g)) if a != c), None) for r, g in zip(ref, got)]
    print(f"free-running: first divergent position per prompt {first}")
    errors = layer_errors(fp8, base, sequences, num_new)
    by_family = defaultdict(list)
    for name in _fp8_layers(fp8):
        by_family[_family(name)].append(errors.get(name))
    print("relative output error per fp8 layer family, mean over its layers/experts (e4m3 rounding alone: 2.7% "
          "RMS per value):")
    for fam, errs in sorted(by_family.items()):
        seen = [e for e in errs if e is not None]  # an expert no token was routed to has no error to show
        mean = f"{sum(seen) / len(seen):.4f}" if seen else "  -   "
        print(f"  {fam:<32} {mean} ({len(errs)} layers)")
    print("agreement with bf16 when only these layers are fp8 (teacher-forced):")
    groups = {f"decoder layer {k}": (lambda n, k=k: n.startswith(f"model.layers.{k}."))
              for k in range(len(fp8.model.model.layers))}
    groups.update({fam: (lambda n, fam=fam: _family(n) == fam) for fam in sorted(by_family)})
    for label, keep in groups.items():
        with fp8_only(fp8, base, keep):
            same = int((forced_logits(fp8, sequences, num_new).argmax(-1) == pick_b).sum())
        print(f"  {label:<32} {same}/{total}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory (default: the embedded LLM)")
    parser.add_argument("--num-new", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--diagnose", action="store_true", help="also print where fp8 and bf16 disagree and why")
    parser.add_argument("--num-prose", type=int, default=64,
                        help="also measure on this many seeded prose prompts (default 64; 0: the 8 prompts only)")
    args = parser.parse_args(argv)
    fixed = print_agreement(args.model, num_new=args.num_new, label=f" ({len(PROMPTS)} prompts)")
    if args.num_prose:
        prose = print_agreement(args.model, prose_prompts(args.num_prose), f" ({args.num_prose} prose prompts)",
                                args.num_new)
        agreed, total = fixed["num_forced"] + prose["num_forced"], fixed["num_tokens"] + prose["num_tokens"]
        print(f"all {len(PROMPTS) + args.num_prose} prompts: teacher-forced greedy agreement {agreed / total:.1%} "
              f"({agreed}/{total}, +- {_interval(agreed, total):.1%}); target 95%")
    if args.diagnose:
        diagnose(args.model, args.num_new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
