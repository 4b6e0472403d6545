"""``metainfer-gen generate``: complete prompts with the LLM engine (embedded default model or a checkpoint)."""

from __future__ import annotations

import argparse
import json

from metainfer_gen.apps.llm_args import add_llm_engine_arguments, add_tp_argument, engine_options


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="complete prompts with the LLM engine",
                              description="Complete one or more prompts with the paged-KV engine and print the "
                                          "text (or JSON lines with tokens, finish reason and timings).")
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one continuous batch)")
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the embedded LLM)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1 keeps all (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (default: engine seed)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the LLM's weights and activations (default bfloat16 where the hardware has it natively: a "
                        "GPU, a CPU with AMX-BF16 or AVX512-BF16; float32 elsewhere; `metainfer-gen doctor` "
                        "says which)")
    add_llm_engine_arguments(p)
    add_tp_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from metainfer_gen.apps.tp_launch import tensor_parallel_pipeline

    with tensor_parallel_pipeline(args.tp, args.model, device=args.device, torch_dtype=args.dtype,
                                  **engine_options(args)) as pipe:
        if pipe is None:  # a worker rank under torchrun: it stepped with rank 0, which prints
            return 0
        outputs = pipe(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason and out.finish_reason.value, "error": out.error,
                              "ttft_s": out.ttft, "mean_token_latency_s": out.mean_token_latency}))
        elif out.error:
            print(f"error: {out.error}")
        else:
            print(out.text)
    return 1 if any(o.error for o in outputs) else 0
