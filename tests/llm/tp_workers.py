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


def greedy_v4_tp(rank: int, world: int, args: dict) -> dict:
    """For each DeepSeek-V4 checkpoint of ``args["runs"]`` ((path, block size) pairs): a TP=world engine's greedy
    tokens with chunked prefill (``args["budget"]`` tokens a step), and this rank's split weights (as lists)."""
    from metainfer_gen import collectives
    from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(max_new_tokens=args["max_new_tokens"], temperature=0.0, ignore_eos=True)
    out = []
    for path, block_size in args["runs"]:
        engine = LLMEngine.from_pretrained(path, EngineConfig(
            tensor_parallel_size=world, block_size=block_size, dtype="float32", max_num_seqs=4,
            max_num_batched_tokens=args["budget"]))
        tokens = [o.token_ids for o in engine.generate(args["prompts"], params)]
        weights = {name: t.tolist() for name, t in engine.model.state_dict().items() if name in args["weights"]}
        out.append({"tokens": tokens, "weights": weights, "states_left": len(engine.model.states)})
    collectives.shutdown_distributed()  # once: a second engine in the process reuses the first one's groups
    return {"runs": out}


def lockstep_v4(rank: int, world: int, args: dict) -> dict:
    """Rank 0 leads a DeepSeek-V4 engine in lockstep and generates; the others follow. Each reports the compressor
    states it still holds after the stop (and rank 0 its tokens)."""
    from metainfer_gen import collectives
    from metainfer_gen.llm import EngineConfig, LLMEngine, SamplingParams
    from metainfer_gen.llm.lockstep import Lockstep

    engine = LLMEngine.from_pretrained(args["path"], EngineConfig(
        tensor_parallel_size=world, block_size=args["block_size"], dtype="float32", max_num_seqs=4,
        max_num_batched_tokens=args["budget"]))
    out = {}
    if rank == 0:
        lead = Lockstep.lead(engine)
        params = SamplingParams(max_new_tokens=args["max_new_tokens"], temperature=0.0, ignore_eos=True)
        out["tokens"] = [o.token_ids for o in engine.generate(args["prompts"], params)]
        lead.stop()
    else:
        out["steps"] = Lockstep.follow(engine)
    out["states_left"] = len(engine.model.states)
    collectives.shutdown_distributed()
    return out
