"""``metainfer-gen plan``: capacity and per-phase parallelism plan from a model config (no weights, no device)."""

from __future__ import annotations

import argparse
import json
import re

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """"48GiB", "80 GB", "1.5gib", "4096" -> bytes.

    Raises:
        ValueError: not a size (the message shows the accepted forms).
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 48GiB, 80GB or 1.5GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def add_plan_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="plan KV capacity and prefill/decode parallelism from a model config",
                              description="From a config alone: weights and KV bytes per rank, prefill activation "
                                          "peak, longest context at a concurrency, collective traffic per "
                                          "TP/CP choice, and a prefill and a decode layout with reasons, against "
                                          "one global TP setting with a 0.90 memory fraction. A DeepSeek-V4 "
                                          "config gets how many sequences of --max-context tokens fit per rank "
                                          "and on the host, per layout and weight format.")
    p.add_argument("--model", required=True, help="checkpoint directory or config .json")
    p.add_argument("--devices", type=int, default=8, help="devices on the host (default 8)")
    p.add_argument("--device-memory", default="48GiB", help="memory per device, e.g. 48GiB (default 48GiB)")
    p.add_argument("--interconnect", choices=("pcie", "nvlink"), default="pcie", help="device links (default pcie)")
    p.add_argument("--link-gbps", type=float, default=None, help="effective GB/s per rank (default: by interconnect)")
    p.add_argument("--max-context", type=int, default=None,
                   help="context to serve (default: report the longest; DeepSeek-V4: max_position_embeddings)")
    p.add_argument("--concurrency", type=int, default=1, help="sequences resident at once (default 1)")
    p.add_argument("--weights", choices=("auto", "bf16", "fp8", "int4"), default="auto",
                   help="weight format (default auto: first of bf16, fp8, int4 that leaves room for KV; "
                        "DeepSeek-V4: rows for bf16 and fp8)")
    p.add_argument("--kv", choices=("bf16", "fp8"), default="fp8",
                   help="KV format of the plan, DeepSeek-V4's state values too (default fp8)")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk, tokens per step (default 8192)")
    p.add_argument("--reserve", default="1.5GiB", help="runtime memory outside tensors per device (default 1.5GiB)")
    p.add_argument("--margin", type=float, default=0.02, help="fraction of device memory kept free (default 0.02)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.set_defaults(func=cmd_plan)


def _plan_mla(cfg: dict, hw, args: argparse.Namespace) -> tuple[dict, str]:
    from metainfer_gen.llm.plan import format_plan, make_plan
    from metainfer_gen.llm.plan_model import ModelDims

    plan = make_plan(ModelDims.from_config(cfg), hw, concurrency=args.concurrency, max_context=args.max_context,
                     weight_format=args.weights, kv_format=args.kv, chunk=args.chunk)
    return plan, format_plan(plan)


def _plan_v4(cfg: dict, hw, args: argparse.Namespace) -> tuple[dict, str]:
    from metainfer_gen.llm.plan_v4_capacity import format_v4_plan, make_v4_plan
    from metainfer_gen.llm.plan_v4_model import V4Dims

    formats = ("bf16", "fp8") if args.weights == "auto" else (args.weights,)
    plan = make_v4_plan(V4Dims.from_config(cfg), hw, context=args.max_context, weight_formats=formats,
                        kv_format=args.kv, chunk=args.chunk)
    return plan, format_v4_plan(plan)


# model_type -> planner; anything else is planned as a DeepSeek-style MLA model (V3, V3.2, GLM-5).
_PLANNERS = {"deepseek_v4": _plan_v4}


def cmd_plan(args: argparse.Namespace) -> int:
    from metainfer_gen.llm.plan import Hardware
    from metainfer_gen.llm.plan_model import read_config

    hw = Hardware(num_devices=args.devices, device_memory=parse_bytes(args.device_memory),
                  interconnect=args.interconnect, reserve=parse_bytes(args.reserve), margin=args.margin,
                  link_gbps=args.link_gbps)
    cfg = read_config(args.model)
    plan, text = _PLANNERS.get(cfg.get("model_type"), _plan_mla)(cfg, hw, args)
    print(json.dumps(plan, indent=2) if args.json else text)
    return 0
