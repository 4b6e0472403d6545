"""Rank bodies for the context-parallel tests and benchmark (run by :func:`tests.collectives.harness.run_ranks`)."""

from __future__ import annotations

import time

import torch


def cp_prefill_decode(rank: int, world: int, args: dict) -> dict:
    """CP prefill over ``world`` ranks, then greedy decode from the paged decode layout (on every rank)."""
    from metainfer_gen.llm.attention_metadata import AttentionMetadata
    from metainfer_gen.llm.context_parallel import ContextParallel, cp_prefill, to_decode_layout
    from metainfer_gen.llm.loader import load_config, load_model
    from metainfer_gen.llm.parallel import TensorParallel
    from pathlib import Path

    cp = ContextParallel.from_env() if world > 1 else ContextParallel()
    path = Path(args["path"])
    prompt = args["prompt"]
    model = load_model(path, load_config(path), dtype=torch.float32, device=torch.device("cpu"),
                       max_positions=len(prompt) + args["max_new_tokens"] + 1, tp=TensorParallel.single())
    start = time.perf_counter()
    result = cp_prefill(model, prompt, cp, tile=args.get("tile", 512))
    seconds = time.perf_counter() - start
    block = 16
    caches, table = to_decode_layout(result.latents, block, -(-(len(prompt) + args["max_new_tokens"]) // block),
                                     torch.float32)
    tokens, length = [result.first_token], len(prompt)
    with torch.inference_mode():
        for _ in range(args["max_new_tokens"] - 1):
            meta = AttentionMetadata.build([length], [1], [table], block)
            hidden = model(torch.tensor(tokens[-1:]), meta, caches)
            tokens.append(int(model.compute_logits(hidden)[0].argmax()))
            length += 1
    return {"tokens": tokens, "logits": result.logits.tolist(), "seconds": seconds,
            "shard": len(cp.shard(len(prompt)))}
