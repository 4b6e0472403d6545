"""Where a clip's seconds go: text encoder, transformer calls, VAE encode and decode, and the rest (set-up).

At the embedded model's own settings a clip's fixed part (everything but the transformer calls) is a large share
of it, so a step cache or fewer steps can no longer move the total; measuring each piece on every call tells which
one bounds a preset. :func:`time_pieces` wraps the pipeline's modules for one call: forward pre/post hooks on the
text encoder and the transformer(s), and the VAE's ``encode`` / ``decode`` methods (instance attributes over the
class's, removed afterwards). On CUDA each boundary synchronises the device, so the pieces are device time.
``setup`` is the call's seconds minus the pieces: scheduler, latents, hooks, the cache's decisions, post-processing.
Calls running at the same time on one pipeline object share its modules, so their pieces mix (the clips do not).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

PIECES = ("text_encoder", "transformer", "vae_encode", "vae_decode")


@contextmanager
def time_pieces(pipe: Any, models: list, device: str) -> Iterator[dict[str, float]]:
    """Seconds per piece of the calls inside the block: ``{piece: seconds}`` over :data:`PIECES`.

    Args:
        pipe: the diffusers pipeline (its ``text_encoder`` and ``vae``). models: its transformer(s).
        device: where they run ("cuda..." synchronises at every boundary).
    """
    import torch

    seconds = {piece: 0.0 for piece in PIECES}
    cuda = str(device).startswith("cuda") and torch.cuda.is_available()

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    handles, patched, started = [], [], {}

    def hooks(module, piece: str) -> None:
        def before(*_args, **_kwargs):
            started[piece] = now()

        def after(*_args, **_kwargs):
            seconds[piece] += now() - started.pop(piece, now())
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))

    encoder = getattr(pipe, "text_encoder", None)
    if encoder is not None:
        hooks(encoder, "text_encoder")
    for model in models:
        hooks(model, "transformer")
    vae = getattr(pipe, "vae", None)
    for method, piece in (("encode", "vae_encode"), ("decode", "vae_decode")):
        if vae is not None and callable(getattr(vae, method, None)) and method not in vae.__dict__:
            original = getattr(vae, method)

            def timed(*args, _original=original, _piece=piece, **kwargs):
                start = now()
                try:
                    return _original(*args, **kwargs)
                finally:
                    seconds[_piece] += now() - start
            object.__setattr__(vae, method, timed)
            patched.append((method, timed))
    try:
        yield seconds
    finally:
        for handle in handles:
            handle.remove()
        for method, timed in patched:  # only our own wrapper (another thread's call may have left first)
            if vae.__dict__.get(method) is timed:
                object.__delattr__(vae, method)


def with_setup(pieces: dict[str, float], total: float) -> dict[str, float]:
    """``pieces`` plus ``"setup"``: the call's ``total`` seconds not spent in any piece (never negative)."""
    return {**pieces, "setup": max(0.0, total - sum(pieces.values()))}
