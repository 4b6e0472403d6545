"""The command-line options that configure the LLM engine, shared by ``metainfer-gen generate`` and ``serve``."""

from __future__ import annotations

import argparse
from typing import Any

from metainfer_gen.apps.arg_types import positive_int


def add_llm_engine_arguments(p: argparse.ArgumentParser) -> None:
    """``--quantization``, ``--kv-cache-dtype`` and ``--enforce-eager`` (read back with :func:`engine_options`)."""
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: linear weights in float8_e4m3fn with 128x128 block scales on any device (an FP8 "
                        "checkpoint keeps its blocks; a bf16 one is quantised on load); default: the checkpoint's "
                        "weights, an FP8 one kept FP8 only on a GPU with an FP8 GEMM (sm_89+/gfx94x+) and "
                        "dequantised once at load elsewhere (the CPU)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="fp8: the latent KV cache in float8_e4m3fn, half the bytes of bf16 (default auto: the run "
                        "dtype)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly: no compiled decode graph on the CPU (built per batch size at "
                        "start-up, tens of seconds each), no CUDA graphs on a GPU (vLLM's flag)")


def add_tp_argument(p: argparse.ArgumentParser) -> None:
    """``--tp N``: tensor-parallel ranks, started by this command (or torchrun's, see ``apps/tp_launch.py``)."""
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=positive_int, default=1,
                   help="tensor-parallel ranks splitting the model (default 1; --tensor-parallel-size is vLLM's "
                        "name); this command starts ranks 1..N-1 on this host, or runs under torchrun "
                        "--nproc-per-node N; rank 0 prints or serves")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~metainfer_gen.llm.config.EngineConfig` fields these options set (only those given)."""
    options: dict[str, Any] = {}
    if args.quantization is not None:
        options["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.enforce_eager:
        options["enforce_eager"] = True
    return options
