"""The command-line options that load a video pipeline, shared by ``metainfer-gen render`` and ``demo``."""

from __future__ import annotations

import argparse
from typing import Any

PRESET_NAMES = ("quality", "balanced", "fastest")  # video.presets.PRESETS, without importing the pipelines here


def add_video_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--vae-dtype``, ``--fused-kernels``, ``--no-embed-memo`` and ``--preset`` (read back with
    :func:`load_options` and :func:`apply_model_options`)."""
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weights dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--vae-dtype", choices=("float32", "bfloat16"), default=None,
                   help="the VAE's own dtype (default: --dtype); bfloat16 decodes about 1.5x faster on a CPU with "
                        "native bf16 ('metainfer-gen doctor' says), 57-62 dB from float32 on the embedded model")
    p.add_argument("--fused-kernels", action="store_true",
                   help="swap the registry kernels into the video transformer and the VAE")
    p.add_argument("--no-embed-memo", dest="embed_memo", action="store_false",
                   help="do not reuse the condition embedder's exact outputs within a call (the memo is lossless "
                        "and on by default where the model has Wan's condition embedder)")
    p.add_argument("--preset", choices=PRESET_NAMES, default=None,
                   help="every acceleration safe for this model and machine at once (pipe.enable_acceleration): "
                        "quality, balanced (also a bf16 VAE where it checks out) or fastest (also the "
                        "model's step LoRA fused and a bf16 transformer where it checks out); the step cache it "
                        "picks stands unless a cache is asked for (--cache, or the request's); default: none")


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """``{"torch_dtype": ..., "vae_dtype": ...}`` for ``from_pretrained`` (None where the option was left out)."""
    import torch

    return {"torch_dtype": getattr(torch, args.dtype) if args.dtype else None,
            "vae_dtype": getattr(torch, args.vae_dtype) if args.vae_dtype else None}


def apply_model_options(pipe, args: argparse.Namespace) -> None:
    """The accelerators the options ask for, on a freshly loaded pipeline (whose ``from_pretrained`` turned the
    lossless embed memo on where the model has Wan's condition embedder): the fused kernels, the memo off
    with ``--no-embed-memo``, then the ``--preset`` (its report, what it turned on and why anything was refused,
    printed to stderr once per loaded model)."""
    if args.fused_kernels:
        pipe.enable_fused_kernels()
    if not args.embed_memo:
        pipe.disable_embed_memo()
    if getattr(args, "preset", None):
        import sys

        print(pipe.enable_acceleration(args.preset).summary(), file=sys.stderr)
