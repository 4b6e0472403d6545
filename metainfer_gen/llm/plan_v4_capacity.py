"""How many DeepSeek-V4 sequences of a given context fit beside the weights and the worst step's activations, per
layout and weight format: the planner's V4 rows (plain Python, no torch; ``metainfer-gen plan`` on a V4 config).

    d = V4Dims.from_config(read_config("benchmarks/configs/deepseek_v4_flash.json"))
    print(format_v4_plan(make_v4_plan(d, Hardware(8, 48 * 2**30), context=1_048_576)))

Layouts over N devices (the engine runs the "TP" layout with bf16/fp32 weights, not "DP attention" or FP8; the
state counted is the minimal one, :func:`~metainfer_gen.llm.plan_v4.v4_state_bytes`: the engine's paged pool also
rounds the compressed entries to whole blocks, ``plan_v4_pool.py``):

- "TP": heads, shared-expert columns and vocabulary over all N ranks, routed experts whole over N; each
  sequence's state is replicated on every rank (one K=V head), so the host holds as many sequences as one rank.
- "DP attention": attention, embedding and head replicated on each rank (``attn_tp = 1``), routed experts over N;
  each rank holds its own sequences, so the host holds N times one rank's.

A rank's budget is ``device_memory * (1 - margin) - reserve - weights``; it must leave the worst step
(:func:`v4_step_activation_bytes`: the larger of a prefill chunk reading the whole context and a decode of every
resident sequence) plus one state (:func:`~metainfer_gen.llm.plan_v4_model.v4_state_bytes_per_sequence`) per
sequence.
"""

from __future__ import annotations

from metainfer_gen.llm.attention_chunks import key_chunk
from metainfer_gen.llm.plan import GIB, Hardware
from metainfer_gen.llm.plan_capacity import largest_fitting
from metainfer_gen.llm.plan_v4 import v4_state_bytes
from metainfer_gen.llm.plan_v4_model import (HCA, KV_ELEMENT_BYTES, SLIDING, V4Dims, v4_state_bytes_per_sequence,
                                             v4_weight_bytes_per_rank)

__all__ = ["make_v4_plan", "format_v4_plan", "v4_step_activation_bytes"]


def _scores(n: int, heads: float, keys: int, head_dim: int, attention: str) -> float:
    """Float32 scores and probabilities of n queries over ``keys`` rows: all at once ("materialised"), or per key
    chunk of :func:`~metainfer_gen.llm.attention_chunks.key_chunk` rows with the online softmax's float32 running
    output and log-sum-exp past one chunk ("blockwise", the engine's MLA prefill convention)."""
    if attention == "materialised":
        return 8 * n * heads * keys
    chunk = min(keys, key_chunk(max(1, round(heads)), n))
    return 8 * n * heads * chunk + (4 * n * heads * (head_dim + 1) if chunk < keys else 0)


def _attention_bytes(d: V4Dims, kind: str, n: int, context: int, heads: float, b: int, attention: str) -> float:
    """Transient bytes of one ``kind`` attention layer for n queries over ``context`` tokens (see
    :func:`v4_step_activation_bytes`)."""
    common = b * n * (2 * d.q_lora_rank + 3 * heads * d.head_dim + d.head_dim + d.o_groups * d.o_lora_rank *
                      heads / d.num_heads)
    if kind == SLIDING:
        return common + _scores(n, heads, d.sliding_window, d.head_dim, attention)
    if kind == HCA:
        # kv and gate (n, D), the gate's softmax in float32; the window plus every entry
        return common + n * d.head_dim * (2 * b + 4) + \
            _scores(n, heads, d.sliding_window + context // d.hca_rate, d.head_dim, attention)
    # CSA: the compressor's and the indexer's kv and gate at 2x width, their window softmax in float32; the
    # indexer's float32 queries and head weights, its head-summed float32 logits over every entry, int64 top-k;
    # the window plus the top-k entries.
    compress = sum(n * 2 * w * 2 * b + 2 * n * w * 4 for w in (d.head_dim, d.index_head_dim))
    indexer = 4 * n * d.index_n_heads * (d.index_head_dim + 1) + 4 * n * (context // d.csa_rate) + \
        8 * n * d.index_topk
    return common + compress + indexer + _scores(n, heads, d.sliding_window + d.index_topk, d.head_dim, attention)


def v4_step_activation_bytes(d: V4Dims, num_queries: int, context: int, attn_tp: int, logit_rows: int = 1,
                             act_bytes: int = 2, attention: str = "blockwise") -> dict[str, float]:
    """Peak live bytes on one rank while a step of ``num_queries`` queries each reads ``context`` tokens (a prefill
    chunk: n tokens of one sequence, ``logit_rows`` 1; a decode: n sequences, ``logit_rows`` n).

    Counts, with heads over ``attn_tp`` ranks and values of ``act_bytes``: the ``hc_mult`` residual streams into and
    out of a block (n, hc, hidden) with the hyper-connection's float32 normed copy and mixes; the collapsed block
    input and its norm; then the larger of the worst attention layer present and the MoE. Attention: the q LoRA
    and its norm, q and its normed, rotated copy (n, heads, head_dim), the K=V row, the output and ``o_a``'s, and
    the float32 scores and probabilities over the keys each query reads: a sliding layer's window; HCA's window
    plus every entry (context / 128), after its compressor's kv and gate; CSA's window plus the top-k entries, after
    two compressors (attention's and the indexer's), the indexer's float32 queries and head weights, its
    head-summed float32 logits over every entry (n x context / 4: this term grows with the context, as V3.2's
    indexer in ``plan_activations``; a fused scorer, not transformers' eager (n, index heads, entries) tensor) and
    int64 top-k. MoE: the float32 router logits and scores, the shared expert's columns, and the (token, expert)
    pairs landing on the rank (n k / attn_tp) with their gate/up/down activations. Plus ``logit_rows`` float32 rows
    of logits. Not counted: the reference path's dense CSA form (``llm/layers/v4_attention.py`` scores every entry
    and the indexer per head), the rope tables, kernels' workspace.

    Args:
        attention: "blockwise" (keys read in chunks, as the engine's MLA prefill: past one chunk HCA's scores stop
            growing) or "materialised" (every key's scores at once: HCA's grow with context / 128).
    Returns:
        {"streams", "attention", "moe", "logits", "peak"} in bytes.
    Raises:
        ValueError: num_queries or attn_tp below 1, a negative context, an unknown attention mode.
    """
    if attention not in ("blockwise", "materialised"):
        raise ValueError(f"attention must be 'blockwise' or 'materialised'; got {attention!r}")
    if num_queries < 1 or attn_tp < 1 or context < 0:
        raise ValueError(f"need num_queries >= 1, attn_tp >= 1, context >= 0; got {num_queries}, {attn_tp}, "
                         f"{context}")
    n, b, h = num_queries, act_bytes, d.hidden
    heads = d.num_heads / attn_tp
    mix = (2 + d.hc_mult) * d.hc_mult
    streams = 2 * n * d.hc_mult * h * b + 4 * n * (d.hc_mult * h + mix) + 2 * n * h * b
    attn = max(_attention_bytes(d, kind, n, context, heads, b, attention) for kind in set(d.layer_types))
    local = n * d.top_k / attn_tp
    moe = b * (n * h + 3 * n * d.moe_intermediate / attn_tp + local * (2 * h + 3 * d.moe_intermediate)) + \
        8 * n * d.num_experts
    logits = 4.0 * d.vocab * logit_rows
    return {"streams": streams, "attention": attn, "moe": moe, "logits": logits,
            "peak": streams + max(attn, moe) + logits}


def _worst_step(d: V4Dims, context: int, seqs: int, attn_tp: int, chunk: int) -> float:
    """Activation bytes the rank leaves free at ``context`` with ``seqs`` resident: the larger of a prefill chunk
    reading the whole context and a decode of ``min(seqs, chunk)`` sequences at it."""
    prefill = v4_step_activation_bytes(d, min(chunk, max(context, 1)), context, attn_tp)["peak"]
    if not seqs:
        return prefill
    batch = min(seqs, chunk)
    return max(prefill, v4_step_activation_bytes(d, batch, context, attn_tp, logit_rows=batch)["peak"])


def _row(d: V4Dims, hw: Hardware, fmt: str, layout: str, context: int, kv_format: str, chunk: int) -> dict:
    """One layout and weight format at ``context``: sizes in GiB, the most sequences a rank and the host hold, and
    the longest context one sequence a rank can have."""
    n = hw.num_devices
    attn_tp, groups = (n, 1) if layout == "TP" else (1, n)
    weights = v4_weight_bytes_per_rank(d, fmt, attn_tp, n)
    budget = hw.device_memory * (1 - hw.margin) - hw.reserve - weights
    state = v4_state_bytes_per_sequence(d, context, kv_format)
    seqs = max(0, int((budget - _worst_step(d, context, 0, attn_tp, chunk)) // state))
    while seqs > 0 and _worst_step(d, context, seqs, attn_tp, chunk) + seqs * state > budget:
        seqs -= 1  # the decode of all of them can be the worse step
    act = _worst_step(d, context, seqs, attn_tp, chunk)
    longest = largest_fitting(lambda x: _worst_step(d, x, 1, attn_tp, chunk) +
                              v4_state_bytes_per_sequence(d, x, kv_format) <= budget, d.max_positions)
    return {"layout": layout, "attn_tp": attn_tp, "expert_ranks": n, "weight_format": fmt,
            "weights_gib": weights / GIB, "activation_gib": act / GIB, "kv_budget_gib": max(0.0, budget - act) / GIB,
            "state_gib": state / GIB, "seqs_per_rank": seqs, "seqs_total": seqs * groups, "fits": seqs > 0,
            "longest_context": longest, "reason": _reason(weights, act, budget, state, seqs)}


def _reason(weights: float, act: float, budget: float, state: float, seqs: int) -> str:
    if seqs:
        return f"{seqs} x {state / GIB:.2f} GiB of state beside {act / GIB:.2f} GiB of activations"
    if budget <= 0:
        return (f"does not fit: weights {weights / GIB:.1f} GiB/rank exceed the {(budget + weights) / GIB:.1f} GiB "
                "budget")
    return (f"does not fit: weights {weights / GIB:.1f} GiB/rank + activations {act / GIB:.2f} GiB leave "
            f"{max(0.0, budget - act) / GIB:.2f} GiB, under one sequence's {state / GIB:.2f} GiB of state")


def make_v4_plan(d: V4Dims, hw: Hardware, *, context: int | None = None, weight_formats: tuple[str, ...] =
                 ("bf16", "fp8"), kv_format: str = "bf16", chunk: int = 8192) -> dict:
    """The V4 rows as a JSON-ready dict: state bytes per sequence at ``context`` by part, and for each layout
    ("TP", "DP attention") and weight format the weights, activation and KV budget per rank (GiB) and the
    sequences of ``context`` tokens that fit per rank and on the host.

    Args:
        context: tokens per sequence (prompt + output); None takes ``max_position_embeddings``.
        weight_formats: keys of ``WEIGHT_FORMATS`` to size.
        kv_format: "bf16" or "fp8" state values.
        chunk: prefill chunk (tokens per step), also the largest decode batch.
    Raises:
        ValueError: a context below 1 or above ``max_position_embeddings``, a chunk below 1, an unknown format.
    """
    context = d.max_positions if context is None else context
    if not 1 <= context <= d.max_positions:
        raise ValueError(f"context {context} must be in [1, max_position_embeddings={d.max_positions}]")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    if kv_format not in KV_ELEMENT_BYTES:
        raise ValueError(f"KV format must be one of {sorted(KV_ELEMENT_BYTES)}; got {kv_format!r}")
    return {
        "model": {"model_type": d.model_type, "layers": d.num_layers, "csa_layers": d.num_csa_layers,
                  "hca_layers": d.num_hca_layers, "hash_layers": d.num_hash_layers, "hidden": d.hidden,
                  "heads": d.num_heads, "experts": d.num_experts, "max_positions": d.max_positions},
        "hardware": {"devices": hw.num_devices, "device_memory_gib": hw.device_memory / GIB,
                     "reserve_gib": hw.reserve / GIB, "margin": hw.margin},
        "request": {"context": context, "chunk": chunk, "kv_format": kv_format},
        "state_bytes_per_sequence": {k: v4_state_bytes(d.state_config, context, size)
                                     for k, size in KV_ELEMENT_BYTES.items()},
        "rows": [_row(d, hw, fmt, layout, context, kv_format, chunk) for layout in ("TP", "DP attention")
                 for fmt in weight_formats],
    }


def format_v4_plan(plan: dict) -> str:
    """Markdown tables of :func:`make_v4_plan`'s result."""
    hw, req = plan["hardware"], plan["request"]
    n = hw["devices"]
    lines = [f"{plan['model']['model_type']} on {n} x {hw['device_memory_gib']:.0f} GiB at {req['context']} tokens "
             f"per sequence ({req['kv_format']} state, prefill chunk {req['chunk']}); minimal state (the engine runs "
             "the TP rows with bf16 weights, not DP attention or fp8)", "",
             "| state bytes/sequence | window | entries | index keys | buffers | total | GiB |",
             "|---|---|---|---|---|---|---|"]
    for k, s in plan["state_bytes_per_sequence"].items():
        lines.append(f"| {k} | {s['window']} | {s['entries']} | {s['index_keys']} | {s['buffers']} | {s['total']} | "
                     f"{s['total'] / GIB:.2f} |")
    lines += ["", "| layout | weights | weights GiB/rank | act GiB | KV GiB/rank | seqs/rank | seqs on host | fits | "
              "longest context, 1 seq/rank |", "|---|---|---|---|---|---|---|---|---|"]
    for r in plan["rows"]:
        name = f"TP{n} (state replicated)" if r["layout"] == "TP" else f"DP{n} attention, EP{n}"
        lines.append(f"| {name} | {r['weight_format']} | {r['weights_gib']:.1f} | {r['activation_gib']:.2f} | "
                     f"{r['kv_budget_gib']:.2f} | {r['seqs_per_rank']} | {r['seqs_total']} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['longest_context']} |")
    lines += [""] + [f"{r['layout']} {r['weight_format']}: {r['reason']}" for r in plan["rows"]]
    return "\n".join(lines)
