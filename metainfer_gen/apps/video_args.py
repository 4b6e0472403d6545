"""The command-line options that load a video pipeline, shared by ``metainfer-gen render`` and ``demo``."""

from __future__ import annotations

import argparse
from typing import Any


def add_video_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--vae-dtype`` and ``--fused-kernels`` (read back with :func:`load_options`)."""
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weights dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--vae-dtype", choices=("float32", "bfloat16"), default=None,
                   help="the VAE's own dtype (default: --dtype); bfloat16 decodes about 1.5x faster on a CPU with "
                        "native bf16 ('metainfer-gen doctor' says), 57-62 dB from float32 on the embedded model")
    p.add_argument("--fused-kernels", action="store_true",
                   help="swap the registry kernels into the video transformer and the VAE")


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """``{"torch_dtype": ..., "vae_dtype": ...}`` for ``from_pretrained`` (None where the option was left out)."""
    import torch

    return {"torch_dtype": getattr(torch, args.dtype) if args.dtype else None,
            "vae_dtype": getattr(torch, args.vae_dtype) if args.vae_dtype else None}
