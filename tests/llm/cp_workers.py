"""Rank bodies for the context-parallel tests and benchmark (run by :func:`tests.collectives.harness.run_ranks`)."""

from __future__ import annotations

import time

import torch


def _layout_decode(model, prompt: list[int], result, max_new_tokens: int) -> list[int]:
    """Greedy tokens decoded by a bare TP=1 model from :func:`to_decode_layout`'s paged caches."""
    from metainfer_gen.llm.attention_metadata import AttentionMetadata
    from metainfer_gen.llm.context_parallel import to_decode_layout

    block = 16
    caches, table = to_decode_layout(result.latents, block, -(-(len(prompt) + max_new_tokens) // block),
                                     torch.float32)
    tokens, length = [result.first_token], len(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens - 1):
            meta = AttentionMetadata.build([length], [1], [table], block)
            hidden = model(torch.tensor(tokens[-1:]), meta, caches)
            tokens.append(int(model.compute_logits(hidden)[0].argmax()))
            length += 1
    return tokens


def _engine_decode(path: str, prompt: list[int], result, max_new_tokens: int, tp_size: int) -> dict:
    """Adopt the prefill into an engine with ``tensor_parallel_size=tp_size`` and decode greedily."""
    from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
    from metainfer_gen.llm.context_parallel import adopt_prefill

    engine = LLMEngine.from_pretrained(path, EngineConfig(tensor_parallel_size=tp_size, block_size=16,
                                                          num_kv_blocks=-(-(len(prompt) + max_new_tokens) // 16)))
    final = adopt_prefill(engine, prompt, result, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                                 ignore_eos=True))
    while engine.has_unfinished_requests:
        final = next((o for o in engine.step() if o.finished), final)
    return {"tokens": final.token_ids, "free_blocks": engine.block_manager.num_free_blocks,
            "num_blocks": engine.block_manager.num_blocks,
            "local_heads": engine.model.model.layers[0].self_attn.num_heads}


def _case(cp, case: dict) -> dict:
    """One CP prefill of ``case["prompt"]`` on ``case["path"]``, then the decodes ``case["decode"]`` names:
    "layout" (bare TP=1 model) and/or "tp" (an engine with tensor_parallel_size = the world size)."""
    from pathlib import Path

    from metainfer_gen.llm.context_parallel import cp_prefill
    from metainfer_gen.llm.loader import load_config, load_model
    from metainfer_gen.llm.parallel import TensorParallel

    path, prompt, new = Path(case["path"]), case["prompt"], case["max_new_tokens"]
    model = load_model(path, load_config(path), dtype=torch.float32, device=torch.device("cpu"),
                       max_positions=len(prompt) + new + 1, tp=TensorParallel.single())
    times = []
    for _ in range(case.get("repeats", 1)):  # the first prefill of a process also pays its first-touch page faults
        start = time.perf_counter()
        result = cp_prefill(model, prompt, cp, tile=case.get("tile", 512))
        times.append(time.perf_counter() - start)
    out = {"seconds": min(times), "first_seconds": times[0], "logits": result.logits.tolist(),
           "shard": len(cp.shard(len(prompt))), "row": result.latents[0].shape[1]}
    if "layout" in case["decode"]:
        out["tokens"] = _layout_decode(model, prompt, result, new)
    if "tp" in case["decode"]:
        out["tp"] = _engine_decode(str(path), prompt, result, new, cp.size)
    return out


def cp_suite(rank: int, world: int, args: dict) -> dict:
    """Every case of ``args["cases"]`` in one spawn (one process start per rank for the whole test file)."""
    from metainfer_gen import collectives
    from metainfer_gen.llm.context_parallel import ContextParallel

    cp = ContextParallel.from_env()
    try:
        return {name: _case(cp, case) for name, case in args["cases"].items()}
    finally:
        collectives.shutdown_distributed()


def cp_prefill_decode(rank: int, world: int, args: dict) -> dict:
    """CP prefill over ``world`` ranks, then greedy decode from the paged decode layout (the benchmark's body)."""
    from metainfer_gen.llm.context_parallel import ContextParallel

    cp = ContextParallel.from_env() if world > 1 else ContextParallel()
    return _case(cp, {**args, "decode": ("layout",)})
