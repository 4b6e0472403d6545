"""What bf16 costs the LLM's answers on this CPU: first-token agreement with transformers, and recall accuracy.

    OMP_NUM_THREADS=2 python benchmarks/llm_bf16_quality.py            # about 2 minutes
    OMP_NUM_THREADS=2 python benchmarks/llm_bf16_quality.py --prompt-lens 300,1000   # prefill-sized MoE batches

1. serve_llm.py's random DeepSeek-V3 (576-wide latent), 64 prompts of 16-200 random tokens (``--prompt-lens``;
   past 256 tokens a prefill routes over 64 pairs an expert, the MoE's prefill-sized path): the share of prompts
   whose first greedy token from our engine equals transformers' in the same dtype (bf16 and fp32 rows), and the
   largest gap between the two engines' last-position logits (float32 values, max |ours - transformers|). Each
   prompt is one prefill step of a warmed-up engine, so it runs the step a server runs: the compiled prefill graph
   where the engine compiles (the "prefill step" column), else the eager model.
2. The embedded LLM's held-out recall tasks (``demo_models.llm.evaluate``, 50 samples each) in float32 and bfloat16.

Random weights make near-ties common (two logits within bf16's rounding), so a flipped first token in bf16 is a
tie broken differently, not a wrong model; the logit gap row says how close they were.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_models import build_random_large, random_prompts  # noqa: E402
from table import print_table, run_footer, run_header  # noqa: E402

from metainfer_gen.llm import EngineConfig, LLMEngine  # noqa: E402
from metainfer_gen.llm.attention_metadata import AttentionMetadata  # noqa: E402


def first_token_rows(path: Path, num_prompts: int, lo: int = 16, hi: int = 200) -> list[list[str]]:
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(num_prompts, 4096, lo, hi, seed=5)
    rows = []
    for dtype in ("bfloat16", "float32"):
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        with torch.inference_mode():
            ref = [ref_model(torch.tensor([p])).logits[0, -1].float() for p in prompts]
        del ref_model
        config = EngineConfig(dtype=dtype, max_model_len=max(1024, hi), max_num_seqs=1)
        engine = LLMEngine.from_pretrained(path, config)
        engine.warmup()  # builds the compiled prefill graph where the engine compiles (what a server runs)
        graph = engine.runner.compiled_prefill
        gaps, agree = [], 0
        blocks = list(range(-(-hi // engine.config.block_size)))
        with torch.inference_mode():
            for p, r in zip(prompts, ref):  # one prefill per prompt on the first blocks; its last logits
                meta = AttentionMetadata.build([0], [len(p)], [blocks], engine.config.block_size)
                ids = torch.tensor(p)
                hidden = graph(ids, meta) if graph is not None else engine.model(ids, meta, engine.runner.kv_caches)
                logits = engine.model.compute_logits(hidden[-1:])[0].float()
                agree += int(logits.argmax()) == int(r.argmax())
                gaps.append(float((logits - r).abs().max()))
        path_name = "compiled" if graph is not None and graph.num_compiled_steps > len(prompts) else "eager"
        rows.append([f"random DeepSeek-V3 (576-wide), {lo}-{hi} tokens", dtype, path_name,
                     f"{agree}/{len(prompts)} ({agree / len(prompts):.1%})",
                     f"{max(gaps):.3g}", f"{sum(gaps) / len(gaps):.3g}"])
    return rows


def recall_rows(num_samples: int) -> tuple[list[list[str]], list[str]]:
    from demo_models.llm.evaluate import evaluate

    rows = []
    for dtype in ("float32", "bfloat16"):
        results = evaluate(None, num_samples, dtype)
        rows.append([dtype] + [f"{v:.0%}" for v in results.values()])
    return rows, list(results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/llm_profile", help="where the random checkpoint is saved")
    parser.add_argument("--num-prompts", type=int, default=64, help="random prompts (default 64)")
    parser.add_argument("--num-samples", type=int, default=50, help="recall samples per task (default 50)")
    parser.add_argument("--prompt-lens", default="16,200", help="random prompts' lengths lo,hi (default 16,200)")
    args = parser.parse_args(argv)
    import time

    start, header = time.perf_counter(), run_header()
    path = Path(args.workdir) / "random-large"
    if not (path / "config.json").exists():
        build_random_large(path)
    print(header)
    print_table(["model", "dtype", "prefill step", "first token = transformers'", "max logit gap", "mean logit gap"],
                first_token_rows(path, args.num_prompts, *(int(v) for v in args.prompt_lens.split(","))))
    rows, tasks = recall_rows(args.num_samples)
    print_table(["embedded LLM dtype", *tasks], rows)
    print(run_footer(time.perf_counter() - start))


if __name__ == "__main__":
    main()
