"""``metainfer-gen doctor``: what this machine can do, and which kernel paths would run here and why not faster.

For each registered op the doctor builds the op's example inputs (realistic sizes) on the default device -- CUDA
when present, else CPU -- and asks the registry which implementation it would pick, without running anything. With
``--strict`` it exits 1 when any op would fall back from its fastest implementation, which makes it a CI gate for a
GPU machine (on a CPU-only machine every Triton path is refused, so strict mode fails there by design). An
implementation built for another device (a oneDNN or C++ CPU kernel on a GPU) is not a path the inputs could take
and is not counted.

The LLM section names every model family's attention path and the engine features it refuses or cannot use yet,
with why (:mod:`metainfer_gen.llm.models.families`); ``--model DIR`` does the same for one checkpoint's config
(no weights read).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform as py_platform
import sys
from dataclasses import dataclass
from typing import TextIO

__all__ = ["OpReport", "cmd_doctor", "collect", "render"]

_PACKAGES = ("torch", "triton", "diffusers", "transformers")


@dataclass(frozen=True, slots=True)
class OpReport:
    op: str
    description: str
    path: str  # implementation that would run on the example inputs
    fastest: str  # the op's fastest registered implementation
    refusals: tuple[tuple[str, str], ...]  # (implementation, reason), fastest first


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect(device: str | None = None, dtype: str | None = None, model: str | None = None) -> dict:
    """Capabilities, versions and per-op selections as a JSON-ready dict.

    Args:
        device: where the example inputs live ("cpu", "cuda"); default CUDA when present, else CPU.
        dtype: "float32", "bfloat16" or "float16" of the example inputs; default the LLM engine's run dtype on
            ``device`` (:func:`metainfer_gen.platform.native_dtype`: bfloat16 on a GPU and on a CPU with AMX-BF16
            or AVX512-BF16, else float32), so the kernel paths listed are the ones a default run takes.
        model: a checkpoint directory or config .json whose attention path and refusals ``report["llm"]
            ["checkpoint"]`` gives (:func:`checkpoint_report`); None: none.
    Raises:
        ValueError: unknown dtype; a config the engine does not run. FileNotFoundError: no config at ``model``.
    """
    import torch

    from metainfer_gen import __version__, host_allocator, platform
    from metainfer_gen.kernels.catalog import registered_ops

    caps = platform.capabilities()
    device = device or ("cuda" if caps.has_gpu else "cpu")
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16; got {dtype!r}")
    checkpoint = None if model is None else checkpoint_report(model)  # a bad path fails before any probing
    triton = platform.triton_status()
    llm_dtype = platform.native_dtype(device)
    dtype = dtype or str(llm_dtype).removeprefix("torch.")
    from metainfer_gen.llm.fp8 import fp8_weights_stay

    fp8_stay, fp8_reason = fp8_weights_stay(device, llm_dtype)
    if checkpoint is not None:
        checkpoint["weights"] = _checkpoint_weights(checkpoint, device, llm_dtype)
    from metainfer_gen.kernels.gemm import matmul_path
    from metainfer_gen.llm.models.families import FAMILIES

    matmul = {}
    for name in ("bfloat16", "float32"):
        path, refused = matmul_path(device, getattr(torch, name))
        matmul[name] = {"path": path, "refused": refused}
    ops = []
    for op in registered_ops():
        if op.example is None:
            ops.append(OpReport(op.name, op.description, "?", op.names[0], (("*", "no example inputs"),)))
            continue
        args, kwargs = op.example(device, getattr(torch, dtype))
        impl, refusals = op.select(*args, **kwargs)
        ops.append(OpReport(op.name, op.description, impl.name, op.fastest_for(torch.device(device).type),
                            tuple((r.implementation, r.reason) for r in refusals)))
    return {
        "machine": {
            "device_kind": caps.device_kind.value,
            "devices": [{"index": i, "name": name, "compute_capability": list(caps.compute_capabilities[i])}
                        for i, name in enumerate(caps.device_names)],
            "gcn_arch": list(caps.gcn_arch),
            "bf16_native": caps.bf16,
            "fp8_e4m3": caps.fp8_e4m3,
            "fp8_e5m2": caps.fp8_e5m2,
            "peer_access": sorted([list(p) for p in caps.peer_access]),
            "missing_peer_pairs": [list(p) for p in caps.missing_peer_pairs()],
            "cpu_capability": caps.cpu_capability,
            "cpu_matrix": caps.cpu_matrix,
            "cpu_threads": torch.get_num_threads(),
            "cxx_compiler": caps.cxx_compiler,
            "host_allocator": host_allocator.current_allocator(),
            "notes": list(caps.notes),
        },
        "llm": {"default_dtype": str(llm_dtype).removeprefix("torch."), "matmul": matmul,
                "decode_step": _decode_step(device, caps),
                "fp8_checkpoints": {"stay_fp8": fp8_stay, "reason": fp8_reason},
                "models": [{"model_type": f.model_type, "attention": f.attention, "missing": f.missing,
                            "refuses": dict(f.refuses), "not_yet": dict(f.not_yet)} for f in FAMILIES.values()],
                "checkpoint": checkpoint},
        "triton": {"mode": triton.mode.value, "version": triton.version, "reason": triton.reason},
        "versions": {"python": py_platform.python_version(), "metainfer-gen": __version__,
                     **{p: _version(p) for p in _PACKAGES}, "torch cuda": caps.torch_cuda or "none",
                     "torch hip": caps.torch_hip or "none"},
        "example": {"device": device, "dtype": dtype},
        "ops": [{"op": o.op, "description": o.description, "path": o.path, "fastest": o.fastest,
                 "refusals": [{"implementation": i, "reason": r} for i, r in o.refusals]} for o in ops],
    }


def _allocator_hint(allocator: str) -> str:
    if allocator == "tcmalloc" or "tuned" in allocator:
        return ""
    if os.environ.get("METAINFER_HOST_ALLOCATOR") == "system":
        return " (METAINFER_HOST_ALLOCATOR=system)"
    return (" (an eager CPU step runs 1.2-1.3x slower on it: the metainfer-gen command re-executes under tcmalloc or "
            "tuned glibc, see metainfer_gen.host_allocator)")


def render(report: dict, out: TextIO) -> None:
    """Print ``report`` (from :func:`collect`) as the human-readable doctor page."""
    m, t, v = report["machine"], report["triton"], report["versions"]
    w = out.write
    w("metainfer-gen doctor\n\nmachine\n")
    w(f"  device kind      {m['device_kind']}\n")
    for d in m["devices"]:
        w(f"  gpu {d['index']:<12} {d['name']} (compute capability {d['compute_capability'][0]}."
          f"{d['compute_capability'][1]})\n")
    w(f"  bf16 native      {'yes' if m['bf16_native'] else 'no'}\n")
    w(f"  fp8 e4m3/e5m2    {'yes' if m['fp8_e4m3'] else 'no'}/{'yes' if m['fp8_e5m2'] else 'no'} (hardware "
      f"arithmetic)\n")
    if len(m["devices"]) > 1:
        missing = m["missing_peer_pairs"]
        w(f"  peer access      {'all pairs' if not missing else f'missing for {missing}'}\n")
    w(f"  cpu              {m['cpu_capability']}, {m['cpu_threads']} torch threads, bf16 matrix unit: "
      f"{m['cpu_matrix'] or 'none'}\n")
    w(f"  c++ compiler     {m['cxx_compiler'] or 'none (torch.compile on CPU unavailable)'}\n")
    w(f"  host allocator   {m['host_allocator']}{_allocator_hint(m['host_allocator'])}\n")
    for note in m["notes"]:
        w(f"  note             {note}\n")
    llm = report["llm"]
    w(f"\nllm engine         runs {llm['default_dtype']} by default here (--dtype to choose)\n")
    for name, mm in llm["matmul"].items():
        mark = "fast    " if mm["refused"] is None else "fallback"
        w(f"  [{mark}] {name:<9} matmuls run {mm['path']}\n")
        if mm["refused"]:
            w(f"               not the fastest: {mm['refused']}\n")
    step = llm["decode_step"]
    w(f"  decode steps     {step['path']}" + (f" ({step['reason']})" if step["reason"] else "") + "\n")
    fp8 = llm["fp8_checkpoints"]
    w(f"  fp8 checkpoints  {'stay FP8' if fp8['stay_fp8'] else 'dequantised at load'}: {fp8['reason']} "
      f"(--quantization fp8 keeps FP8)\n")
    for fam in llm["models"]:
        if fam["missing"] is None:
            w(f"  model {fam['model_type']:<13} attention: {fam['attention']}\n")
            _render_limits(w, fam, " " * 22)
        else:
            w(f"  model {fam['model_type']:<13} not supported yet: lacks {fam['missing']}\n")
    if llm["checkpoint"] is not None:
        ckpt = llm["checkpoint"]
        w(f"\nllm checkpoint     {ckpt['path']}\n  attention        {ckpt['attention']}\n")
        w(f"  weights          {ckpt['weights']['name']}: {ckpt['weights']['reason']}\n")
        _render_limits(w, ckpt, "  ")
    w(f"\ntriton             {t['mode']}" + (f" ({t['reason']})" if t["reason"] else "") + "\n")
    w("\nversions\n")
    for name, version in v.items():
        w(f"  {name:<16} {version or 'not installed'}\n")
    ex = report["example"]
    w(f"\nkernels (example inputs on {ex['device']}, {ex['dtype']})\n")
    for o in report["ops"]:
        mark = "fast    " if not o["refusals"] else "fallback"
        w(f"  [{mark}] {o['op']:<20} runs {o['path']:<9} (fastest: {o['fastest']})\n")
        for r in o["refusals"]:
            w(f"               refused {r['implementation']}: {r['reason']}\n")
    slow = [o["op"] for o in report["ops"] if o["refusals"]]
    w(f"\n{len(report['ops']) - len(slow)} of {len(report['ops'])} ops run their fastest path here"
      + (f"; falling back: {', '.join(slow)}" if slow else "") + "\n")


# How the family table's feature names read on the page.
_FEATURES = {"prefix_caching": "prefix caching", "compiled_decode": "compiled decode steps (they run eager)",
             "fp8": "FP8 weights and KV cache", "tensor_parallel": "tensor parallelism"}


def _render_limits(w, entry: dict, indent: str) -> None:
    """The features a family (or checkpoint) refuses and those it cannot use yet, one line each, with why."""
    for kind, key in (("refuses", "refuses"), ("not yet", "not_yet")):
        for feature, why in entry[key].items():
            w(f"{indent}{kind} {_FEATURES.get(feature, feature)}: {why}\n")


def checkpoint_report(model: str) -> dict:
    """The attention path the engine would run for the checkpoint (or config .json) at ``model``, as the audit
    names it (shared-top-k layers counted), what its family refuses or cannot use yet, and its declared weight
    quantisation (None or ``"fp8"``); reads the config only (:func:`collect` adds how the weights load here).

    Raises:
        FileNotFoundError: no config there. ValueError: not JSON, a model type the engine does not run, or a
            ``quantization_config`` it cannot load.
    """
    from types import SimpleNamespace

    from metainfer_gen.llm.fp8 import checkpoint_quantization
    from metainfer_gen.llm.models.families import attention_path, family_of
    from metainfer_gen.llm.plan_model import read_config

    config = read_config(model)
    family = family_of(config.get("model_type"))
    fields = {"indexer_types": None, "num_hidden_layers": 0, "quantization_config": None} | config
    namespace = SimpleNamespace(**fields)
    return {"path": str(model), "model_type": family.model_type, "attention": attention_path(namespace),
            "refuses": dict(family.refuses), "not_yet": dict(family.not_yet),
            "quantization": checkpoint_quantization(namespace)}


def _checkpoint_weights(ckpt: dict, device: str, dtype) -> dict:
    """How :func:`checkpoint_report`'s checkpoint would hold its linear weights on ``device`` by default, as the
    loader decides (:func:`~metainfer_gen.llm.fp8.choose_weight_format`): ``name`` and ``reason``."""
    from metainfer_gen.llm.fp8 import choose_weight_format
    from metainfer_gen.llm.models.families import FAMILIES

    fmt = choose_weight_format(None, ckpt["quantization"], device, dtype, FAMILIES[ckpt["model_type"]].no_fp8_layers)
    return {"name": fmt.name, "reason": fmt.reason}


def cmd_doctor(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Entry point of ``metainfer-gen doctor``; returns 1 under ``--strict`` when any fast path is refused, 2
    when ``--model`` names no config the engine runs."""
    out = sys.stdout if out is None else out
    try:
        report = collect(device=args.device, dtype=args.dtype, model=getattr(args, "model", None))
    except (FileNotFoundError, ValueError) as exc:
        if getattr(args, "model", None) is None:
            raise
        print(f"error: --model: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        render(report, out)
    refused = any(o["refusals"] for o in report["ops"])
    return 1 if (args.strict and refused) else 0


def _decode_step(device: str, caps) -> dict:
    """How the LLM engine runs decode steps here (``llm/compiled_decode.py``; the model can still refuse)."""
    if device.startswith("cuda"):
        return {"path": "eager, or CUDA graphs with static_decode", "reason": None}
    if caps.cxx_compiler is None:
        return {"path": "eager", "reason": "torch.compile on the CPU needs a C++ compiler (install g++)"}
    return {"path": "compiled, one graph per batch size (--enforce-eager: eager)",
            "reason": "DSA sparse attention (DeepSeek-V3.2, GLM-5), DeepSeek-V4 and tensor parallelism run eager"}
