"""Rank bodies for the tensor-parallel engine test (run by :func:`tests.collectives.harness.run_ranks`)."""

from __future__ import annotations

import time

import torch


def greedy_tp(rank: int, world: int, args: dict) -> dict:
    """TP=world engine on the checkpoint: greedy tokens, prefill logits, collective paths, time in collectives."""
    from metainfer_gen import collectives, kernels
    from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
    from metainfer_gen.llm.attention_metadata import AttentionMetadata

    engine = LLMEngine.from_pretrained(args["path"], EngineConfig(tensor_parallel_size=world, block_size=4,
                                                                  max_num_batched_tokens=96))
    prompt = args["logit_prompt"]
    meta = AttentionMetadata.build([0], [len(prompt)], [list(range(10))], 4)
    with torch.inference_mode():
        logits = engine.model.compute_logits(engine.model(torch.tensor(prompt), meta, engine.runner.kv_caches))
    engine.runner.kv_caches = [torch.zeros_like(c) for c in engine.runner.kv_caches]
    params = SamplingParams(max_new_tokens=args["max_new_tokens"], temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    with kernels.audit() as report:
        outputs = engine.generate(args["prompts"], params)
    seconds = time.perf_counter() - start
    collectives.shutdown_distributed()
    return {"tokens": [o.token_ids for o in outputs], "logits": logits.tolist(), "seconds": seconds,
            "paths": {op: paths for op, paths in report.paths().items() if op in ("all_reduce", "all_gather")},
            "sites": sorted({e.site for e in report.entries if e.op in ("all_reduce", "all_gather")}),
            "local_heads": engine.model.model.layers[0].self_attn.num_heads,
            "local_experts": sorted(int(k) for layer in engine.model.model.layers
                                    if hasattr(layer.mlp, "experts") for k in layer.mlp.experts)[:16]}
