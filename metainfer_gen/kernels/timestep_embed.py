"""Timestep embeddings computed once per distinct timestep and gathered per token.

Wan 2.2 TI2V (diffusers ``WanTransformer3DModel`` with ``expand_timesteps``: the TI2V-5B model and our embedded demo
model) conditions every token on its own timestep: the pipeline passes a ``(B, S)`` timestep (0 on the clean first
latent frame of image-to-video, ``t`` elsewhere), and ``WanTimeTextImageEmbedding`` runs the sinusoidal projection,
the two-layer ``time_embedder`` MLP and the ``time_proj`` linear (``dim -> 6 * dim``) on all ``B * S`` rows. Those
rows hold one or two distinct values. On TI2V-5B at 704x1280 and 121 frames (S = 27 280 tokens, dim 3072: 67 M
multiply-adds per row) that is about 3.6 TFLOP per transformer call spent on 27 278 repeats (under 1% of the
call); on the embedded model, whose blocks are small, it was 2.3 of a 34 ms transformer call on this CPU (one
thread; 0.8 ms with this op).

    timestep_embedding(timestep, embed) == embed(timestep)   # row by row, up to float rounding

Implementations, fastest first: ``unique`` (``torch.unique(timestep, return_inverse=True)``, ``embed`` on the
distinct values, ``index_select`` back, or, when all rows share one value (text-to-video), an ``expand`` view of
the one row: stride 0 along the rows, no copy; any device and dtype; on a GPU ``torch.unique`` synchronises the
host once) and ``torch`` (``embed`` on every row: the reference). A matrix product over fewer rows may round
differently in the last bit (the GEMM blocks differently), hence the float tolerance below.
"""

from __future__ import annotations

from typing import Callable

import torch

from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["timestep_embedding", "timestep_embedding_reference", "timestep_embedding_unique"]

Embed = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def timestep_embedding_reference(timestep: torch.Tensor, embed: Embed) -> tuple[torch.Tensor, ...]:
    """``embed(timestep)``: every row computed."""
    return tuple(embed(timestep))


def timestep_embedding_unique(timestep: torch.Tensor, embed: Embed) -> tuple[torch.Tensor, ...]:
    """``embed`` on the distinct values of ``timestep``, gathered back to one row per entry."""
    values, inverse = torch.unique(timestep, return_inverse=True)
    outputs = embed(values)
    if len(values) == 1:  # one timestep for every token (text-to-video): a broadcast view instead of M copies
        return tuple(out.expand(len(timestep), *out.shape[1:]) for out in outputs)
    return tuple(out.index_select(0, inverse) for out in outputs)


def _one_dimensional(timestep: torch.Tensor, embed: Embed) -> str | None:
    if timestep.ndim != 1:
        return f"timestep is {timestep.ndim}-D; the row gather needs a flat (M,) timestep"
    return None


def _example(device: str, dtype: torch.dtype):
    # Wan 2.2 TI2V embedder at the embedded model's size: 2 samples x 320 tokens, first latent frame clean.
    freq, dim = 256, 128
    gen = torch.Generator().manual_seed(0)
    w1, w2, w3 = (torch.randn(o, i, generator=gen).to(device, dtype) * i ** -0.5
                  for o, i in ((dim, freq), (dim, dim), (6 * dim, dim)))
    half = torch.arange(freq // 2, device=device, dtype=torch.float32)
    frequencies = torch.exp(-9.210340371976184 * half / (freq // 2))  # ln(10000)

    def embed(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = t.float()[:, None] * frequencies[None]
        projected = torch.cat([angles.cos(), angles.sin()], dim=1).to(dtype)
        temb = torch.nn.functional.silu(projected @ w1.T) @ w2.T
        return temb, torch.nn.functional.silu(temb) @ w3.T

    timestep = torch.full((2, 320), 700.0, device=device)
    timestep[:, :64] = 0.0
    return (timestep.flatten(), embed), {}


TIMESTEP_EMBEDDING = register_op(Op("timestep_embedding", "per-token timestep MLP, once per distinct value",
                                    _example))
TIMESTEP_EMBEDDING.register("unique", timestep_embedding_unique, _one_dimensional,
                            description="embed the distinct timesteps once, gather per token")
TIMESTEP_EMBEDDING.register("torch", timestep_embedding_reference, description="embed every row (the reference)")


def timestep_embedding(timestep: torch.Tensor, embed: Embed, *, site: str | None = None,
                       strict: bool | None = None) -> tuple[torch.Tensor, ...]:
    """Apply a row-wise timestep embedding ``embed`` to ``timestep``, computing each distinct value once.

    Args:
        timestep: (M,) timesteps, one per token (or per sample), any dtype ``embed`` accepts.
        embed: ``embed(t) -> (out_1, ...)`` for a (K,) tensor ``t``, each output (K, ...), row k depending on
            ``t[k]`` alone (Wan's ``timesteps_proj`` -> ``time_embedder`` -> ``time_proj`` chain is).
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        The outputs of ``embed``, each (M, ...), as ``embed(timestep)`` would give them up to float rounding
        (atol=rtol=1e-5 in float32). Treat them as read-only: when every row shares one timestep they are
        broadcast views of one row (stride 0 along M; ``.contiguous()`` gives a copy).
    Raises:
        ValueError: ``timestep`` is not a tensor or ``embed`` is not callable.
    """
    if not isinstance(timestep, torch.Tensor):
        raise ValueError(f"timestep must be a tensor; got {type(timestep).__name__}")
    if not callable(embed):
        raise ValueError(f"embed must be callable (t -> tuple of (K, ...) tensors); got {type(embed).__name__}")
    return TIMESTEP_EMBEDDING.dispatch(timestep, embed, site=site, strict=strict, stacklevel=2)
