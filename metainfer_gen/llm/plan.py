"""Capacity and parallelism plan per phase, from a model config and the hardware alone (no weights, no device).

    plan = make_plan(ModelDims.from_path("benchmarks/configs/deepseek_v32.json"),
                     Hardware(num_devices=8, device_memory=48 * 2**30, interconnect="pcie"), concurrency=16)
    print(format_plan(plan)); json.dumps(plan)

Layouts (N devices, all of them used in both phases; a rank's weights are the union of what both layouts need):

- prefill (tp, cp), tp * cp = N: ``cp`` groups each take 1/cp of a prompt's tokens (context parallelism, ring
  exchange of latent rows), heads split over the ``tp`` ranks of a group, routed experts over all N ranks.
- decode (tp = N, dcp): heads and experts split over all ranks; every sequence's KV rows are sharded over ``dcp``
  ranks of the group (vLLM's decode context parallelism: MLA's latent row is otherwise replicated on every
  tensor-parallel rank, so TP alone never shrinks KV per rank).
- what the engine runs (bf16/FP8 weights, TP over all devices, CP 1, DCP 1) is the plan; the best other layout is
  reported beside it as "not built", with what the engine lacks for it (:data:`NOT_BUILT`).
- the single global setting it is compared with: tp = N in both phases, latent replicated, bf16 KV, and a static
  memory fraction of 0.90 (vLLM's ``gpu_memory_utilization`` default) instead of a measured reserve.

Activations: each layout leaves free the engine's worst step at the context it is planned for (the largest prefill
chunk reading that whole context, the largest decode batch at it), and that context is the longest one whose
activation, weights and KV fit together, found by bisection (:mod:`metainfer_gen.llm.plan_capacity`): a DSA
indexer's scores grow with the context, so the first chunk alone would overstate what fits.

Collective bytes are per rank per token, summed over layers; seconds come from an assumed effective per-link
bandwidth (``LINK_GBPS``; override it per run), latency ignored. Sources: vLLM docs (context parallel deployment),
DeepSeek-V3 report (prefill/decode deployment), Ring Attention (arXiv:2310.01889).
"""

from __future__ import annotations

from dataclasses import dataclass

from metainfer_gen.llm.plan_capacity import layout_limits
from metainfer_gen.llm.plan_model import (WEIGHT_FORMATS, ModelDims, kv_bytes_per_token,
                                          weight_bytes_per_rank)

GIB = 2**30
LINK_GBPS = {"pcie": 24.0, "nvlink": 200.0}  # effective GB/s per rank (PCIe 4.0 x16; A100-class NVLink bus bw)
BASELINE_FRACTION = 0.90


@dataclass(frozen=True, slots=True)
class Hardware:
    """The devices the plan is for.

    Args:
        num_devices: devices on one host, >= 1.
        device_memory: bytes per device.
        interconnect: "pcie" or "nvlink".
        reserve: bytes per device kept for the runtime outside tensors (CUDA context, collective buffers, graphs).
        margin: fraction of device memory kept free for allocator fragmentation.
        link_gbps: effective GB/s per rank; None takes ``LINK_GBPS[interconnect]``.
    Raises:
        ValueError: a value out of range.
    """

    num_devices: int
    device_memory: int
    interconnect: str = "pcie"
    reserve: int = int(1.5 * GIB)
    margin: float = 0.02
    link_gbps: float | None = None

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.device_memory <= 0:
            raise ValueError(f"need num_devices >= 1 and device_memory > 0; got {self.num_devices}, "
                             f"{self.device_memory}")
        if self.interconnect not in LINK_GBPS:
            raise ValueError(f"interconnect must be one of {sorted(LINK_GBPS)}; got {self.interconnect!r}")
        if not 0 <= self.margin < 0.5:
            raise ValueError(f"margin must be in [0, 0.5); got {self.margin}")

    @property
    def bandwidth(self) -> float:
        """Bytes per second per rank."""
        return (self.link_gbps or LINK_GBPS[self.interconnect]) * 1e9


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def prefill_comm_bytes(d: ModelDims, tp: int, cp: int, kv_token_bytes: float, act_bytes: int = 2) -> dict:
    """Bytes a rank moves per prompt token in the prefill layout (tp, cp), by collective.

    Two all-reduces of the hidden state per layer in a group (a rank sees 1/cp of the tokens); the ring passes each
    token's KV rows (latent + indexer keys) to the other cp - 1 groups; a token's hidden goes to the group holding
    each of its k experts and back (shared by the group's tp ranks).
    """
    h = d.hidden * act_bytes
    out = {"tp_all_reduce": d.num_layers * 2 * 2 * (tp - 1) / tp * h / cp,
           "cp_ring_kv": (cp - 1) / cp * kv_token_bytes,
           "ep_all_to_all": d.num_moe_layers * 2 * d.top_k * h * (cp - 1) / cp / (tp * cp)}
    return {**out, "total": sum(out.values())}


def decode_comm_bytes(d: ModelDims, tp: int, dcp: int, act_bytes: int = 2) -> dict:
    """Bytes a rank moves per decode token with heads over ``tp`` ranks and KV sharded over ``dcp`` of them:
    two all-reduces per layer, plus the queries of the dcp group's other heads (absorbed, latent width) and the
    float32 partial outputs with their log-sum-exp back (vLLM decode context parallelism)."""
    heads = d.num_heads / tp
    out = {"tp_all_reduce": d.num_layers * 2 * 2 * (tp - 1) / tp * d.hidden * act_bytes,
           "dcp_exchange": d.num_layers * (dcp - 1) * heads * (d.latent_row * act_bytes + (d.kv_lora_rank + 1) * 4)}
    return {**out, "total": sum(out.values())}


def _evaluate(d, hw, fmt, kv_fmt, chunk, cp, dcp, concurrency, context, fraction=None) -> dict:
    """One layout's sizes, limits and traffic. ``fraction`` None: the measured-style budget (device minus reserve
    and margin); otherwise the static fraction of device memory. The activation is the worst step at the planned
    context (:func:`~metainfer_gen.llm.plan_capacity.layout_limits`), as the engine's KV sizing profiles it."""
    n = hw.num_devices
    tp = n // cp
    weights = weight_bytes_per_rank(d, fmt, attn_tp=tp, expert_ranks=n)
    total = hw.device_memory * (1 - hw.margin) - hw.reserve if fraction is None else hw.device_memory * fraction
    kv_tok = kv_bytes_per_token(d, kv_fmt)["total"]
    lim = layout_limits(d, total - weights, kv_tok, chunk, tp, cp, dcp, concurrency, context, d.max_positions)
    pre, dec = prefill_comm_bytes(d, tp, cp, kv_tok), decode_comm_bytes(d, n, dcp)
    return {"prefill": {"tp": tp, "cp": cp}, "decode": {"tp": n, "dcp": dcp}, "weight_format": fmt,
            "weights_gib": weights / GIB, "activation_gib": lim["activation"] / GIB,
            "activation_context": lim["planned_context"], "kv_budget_gib": lim["kv_budget"] / GIB,
            "kv_token_bytes": kv_tok, "capacity_tokens": lim["capacity_tokens"],
            "max_context": lim["max_context"], "max_context_uncapped": lim["max_context_uncapped"],
            "max_concurrency": lim["max_concurrency"],
            "prefill_comm_bytes": pre, "decode_comm_bytes": dec,
            "prefill_comm_us": pre["total"] / hw.bandwidth * 1e6, "decode_comm_us": dec["total"] / hw.bandwidth * 1e6}


# What the engine runs (llm/engine.py, config.py): bf16 or FP8 weights, bf16 or FP8 KV, one tensor-parallel size
# for prefill and decode. Everything else the planner can size is marked with why it is not built.
BUILT_WEIGHT_FORMATS = ("bf16", "fp8")
NOT_BUILT = {
    "int4": "int4 weights (the engine loads bf16 or FP8)",
    "cp": "context-parallel prefill inside the engine (llm/context_parallel.py runs beside the scheduler, every "
          "rank holding the whole model: no CP x TP grid)",
    "dcp": "decode context parallelism (the latent row is replicated on every tensor-parallel rank)",
}


def not_built(fmt: str, cp: int, dcp: int) -> list[str]:
    """Why the engine cannot run weights ``fmt`` with prefill CP ``cp`` and decode KV sharding ``dcp`` (empty: it
    can)."""
    return [NOT_BUILT[k] for k, off in (("int4", fmt not in BUILT_WEIGHT_FORMATS), ("cp", cp > 1),
                                         ("dcp", dcp > 1)) if off]


def _choose(d, hw, formats, kv_format, chunk, layouts, concurrency, target):
    """(best option, every option, weight format, whether one holds ``target``) over ``layouts`` (cp, dcp) with the
    first of ``formats`` that leaves room for KV (the last one when none does)."""
    fmt = next((f for f in formats if _evaluate(d, hw, f, kv_format, chunk, 1, max(dcp for _, dcp in layouts), 1,
                                                0)["max_context_uncapped"] > 0), formats[-1])
    options = [_evaluate(d, hw, fmt, kv_format, chunk, cp, dcp, concurrency, target) for cp, dcp in layouts]
    for o in options:
        o["not_built"] = not_built(fmt, o["prefill"]["cp"], o["decode"]["dcp"])
    feasible = [o for o in options if o["max_context_uncapped"] >= target] if target else []
    if feasible:
        best = min(feasible, key=lambda o: (o["prefill_comm_us"] + o["decode_comm_us"]))
    else:
        best = max(options, key=lambda o: (o["max_context"], o["max_context_uncapped"], -o["weights_gib"],
                                           -(o["prefill_comm_us"] + o["decode_comm_us"])))
    return best, options, fmt, bool(feasible)


def make_plan(d: ModelDims, hw: Hardware, *, concurrency: int = 1, max_context: int | None = None,
              weight_format: str = "auto", kv_format: str = "fp8", chunk: int = 8192) -> dict:
    """The plan the engine can run, the best layout it cannot run yet (marked with why), and the single-setting
    baseline, as a JSON-ready dict (sizes in GiB, bytes, tokens).

    ``plan`` is chosen among what the engine runs (:data:`BUILT_WEIGHT_FORMATS`, TP over all devices, CP 1, DCP
    1); ``not_built`` is the best over every format and (CP, DCP) layout, with ``not_built`` reasons, or None when
    it is the plan itself. Every entry of ``options`` carries its ``not_built`` list (empty: the engine runs it).
    Each entry's ``activation_gib``, ``kv_budget_gib`` and ``capacity_tokens`` are at ``activation_context``:
    ``max_context`` when it fits, else the longest context that fits at ``concurrency`` (one chunk when none).

    Args:
        concurrency: sequences resident at once (C).
        max_context: the context (prompt + output tokens) to serve; None asks for the longest at C.
        weight_format: "bf16", "fp8", "int4", or "auto" (the first of those that leaves room for KV; the plan only
            considers the ones the engine loads).
        kv_format: "bf16" or "fp8" for the plan (the baseline always keeps bf16).
        chunk: prefill chunk (tokens per step across the prefill group).
    Raises:
        ValueError: bad arguments.
    """
    if concurrency < 1 or chunk < 1 or (max_context is not None and max_context < 1):
        raise ValueError("concurrency, chunk and max_context must be >= 1")
    n = hw.num_devices
    formats = list(WEIGHT_FORMATS) if weight_format == "auto" else [weight_format]
    built_formats = [f for f in formats if f in BUILT_WEIGHT_FORMATS] or formats
    target = max_context or 0
    layouts = [(cp, dcp) for cp in _divisors(n) for dcp in _divisors(n)]
    best, _, fmt, feasible = _choose(d, hw, built_formats, kv_format, chunk, [(1, 1)], concurrency, target)
    other, options, _, other_feasible = _choose(d, hw, formats, kv_format, chunk, layouts, concurrency, target)
    base = _evaluate(d, hw, fmt, "bf16", chunk, 1, 1, concurrency, target, fraction=BASELINE_FRACTION)
    # worth showing when it serves more: a longer context, or the target the engine's own layout cannot hold
    better = bool(other["not_built"]) and (other["max_context"] > best["max_context"] or (other_feasible
                                                                                          and not feasible))
    return {
        "model": {"model_type": d.model_type, "layers": d.num_layers, "hidden": d.hidden, "heads": d.num_heads,
                  "experts": d.num_experts, "indexer": bool(d.index_head_dim), "max_positions": d.max_positions},
        "hardware": {"devices": n, "device_memory_gib": hw.device_memory / GIB, "interconnect": hw.interconnect,
                     "link_gbps": hw.bandwidth / 1e9, "reserve_gib": hw.reserve / GIB, "margin": hw.margin},
        "request": {"concurrency": concurrency, "max_context": max_context, "chunk": chunk},
        "weights_per_rank_gib": {f: weight_bytes_per_rank(d, f, n, n) / GIB for f in WEIGHT_FORMATS},
        "weight_format": fmt,
        "kv_bytes_per_token": {k: kv_bytes_per_token(d, k) for k in ("bf16", "fp8")},
        "kv_format": kv_format,
        "options": options,
        "plan": {**best, "reasons": _reasons(best, [best], base, target, concurrency, feasible)},
        "not_built": {**other, "reasons": _reasons(other, options, base, target, concurrency, other_feasible)}
        if better else None,
        "baseline": {**base, "kv_format": "bf16", "memory_fraction": BASELINE_FRACTION},
    }


def _reasons(best: dict, options: list[dict], base: dict, target: int, conc: int, feasible: bool) -> dict:
    tp, cp, dcp = best["prefill"]["tp"], best["prefill"]["cp"], best["decode"]["dcp"]
    kb = best["prefill_comm_bytes"]["total"] / 1e3
    same_dec = [o for o in options if o["decode"]["dcp"] == dcp]
    cp1 = next(o for o in same_dec if o["prefill"]["cp"] == 1)
    goal = (f"holds {target} tokens x {conc}" if feasible else
            f"longest context at concurrency {conc}" + (f" ({target} x {conc} fits no layout)" if target else ""))
    prefill = (f"TP={tp} x CP={cp}: {goal}; a rank keeps 1/{cp} of the prompt's KV while prefilling, moves "
               f"{kb:.1f} KB/token ({best['prefill_comm_us']:.2f} us) against "
               f"{cp1['prefill_comm_bytes']['total'] / 1e3:.1f}"
               f" KB at CP=1, weights {best['weights_gib']:.1f} GiB/rank (attention heads over {tp} ranks)")
    decode = (f"TP={best['decode']['tp']} with KV sharded over {dcp} rank(s): capacity {best['capacity_tokens']} "
              f"token rows/rank covers {dcp}x that many tokens of context, {best['decode_comm_us']:.2f} us/token "
              f"of traffic; the global TP={base['decode']['tp']} setting replicates the latent and stops at "
              f"{base['max_context']} tokens at concurrency {conc}")
    if not best["max_context_uncapped"]:
        need = min((o["weights_gib"] + o["activation_gib"]) for o in options)
        prefill = decode = (f"does not fit: weights {best['weights_gib']:.1f} GiB/rank + activations + reserve "
                            f"leave no KV memory; each device needs more than {need:.1f} GiB plus reserve and "
                            f"margin (or more devices, or a smaller weight format)")
    return {"prefill": prefill, "decode": decode}


def format_plan(plan: dict) -> str:
    """Markdown tables: per-rank sizes, the options, and plan vs the best layout not built vs baseline."""
    hw, p, b = plan["hardware"], plan["plan"], plan["baseline"]
    kv = plan["kv_bytes_per_token"]
    lines = [f"{plan['model']['model_type']} on {hw['devices']} x {hw['device_memory_gib']:.0f} GiB "
             f"({hw['interconnect']}, {hw['link_gbps']:.0f} GB/s assumed)", "",
             "| weights/rank (TP=N) | " + " | ".join(plan["weights_per_rank_gib"]) + " |",
             "|---|" + "---|" * len(plan["weights_per_rank_gib"]),
             "| GiB | " + " | ".join(f"{v:.1f}" for v in plan["weights_per_rank_gib"].values()) + " |", "",
             "| KV bytes/token (all layers) | latent | indexer | total |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['latent']:.0f} | {v['indexer']:.0f} | {v['total']:.0f} |" for k, v in kv.items()]
    lines += ["", "| setting | prefill | decode | weights GiB | act GiB | KV GiB | KV rows/rank | context @C | "
              "C @context | prefill KB/tok | decode KB/tok |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [("plan", p)] + ([("not built", plan["not_built"])] if plan["not_built"] else []) + [("global", b)]
    for name, o in rows:
        lines.append(f"| {name} | TP{o['prefill']['tp']} CP{o['prefill']['cp']} | TP{o['decode']['tp']} "
                     f"DCP{o['decode']['dcp']} | {o['weights_gib']:.1f} | {o['activation_gib']:.2f} | "
                     f"{o['kv_budget_gib']:.2f} | {o['capacity_tokens']} | {o['max_context']} | "
                     f"{o['max_concurrency'] if o['max_concurrency'] is not None else '-'} | "
                     f"{o['prefill_comm_bytes']['total'] / 1e3:.1f} | {o['decode_comm_bytes']['total'] / 1e3:.1f} |")
    lines += ["", f"prefill: {p['reasons']['prefill']}", f"decode: {p['reasons']['decode']}"]
    if plan["not_built"]:
        nb = plan["not_built"]
        lines += ["", f"not built ({nb['weight_format']} weights), what the engine lacks for it: "
                  + "; ".join(nb["not_built"]), f"  prefill: {nb['reasons']['prefill']}",
                  f"  decode: {nb['reasons']['decode']}"]
    return "\n".join(lines)
