"""Fuser for Wan's condition embedder: the per-token timestep MLP through ``timestep_embedding``.

``WanTimeTextImageEmbedding.forward(timestep, encoder_hidden_states, encoder_hidden_states_image=None,
timestep_seq_len=None)`` (diffusers ``transformer_wan.py`` at 0.42.1) embeds the flat timestep (``(B,)``, or
``(B * S,)`` with ``timestep_seq_len=S`` for Wan 2.2 TI2V) through ``timesteps_proj`` -> ``time_embedder`` (cast
to its weight dtype) -> ``temb`` (in the prompt's dtype) -> ``time_proj(act_fn(temb))``, then projects the prompt
and image embeddings. The hook computes the same chain on the distinct timesteps only
(:mod:`metainfer_gen.kernels.timestep_embed`) and leaves the prompt and image projections as they are. Weights
and modules are untouched; ``unfuse_kernels`` restores the original forward.
"""

from __future__ import annotations

import inspect

import torch

from metainfer_gen.video.fuse.core import FuseKernelsConfig
from metainfer_gen.video.fuse.wan import _model_hook_base, _register
from metainfer_gen.kernels.timestep_embed import timestep_embedding

__all__ = ["WAN_EMBEDDER_ARGS", "WAN_EMBEDDER_PARTS", "FusedWanConditionEmbedderHook",
           "fuse_wan_condition_embedder"]

# The parameters of diffusers' WanTimeTextImageEmbedding.forward (also checked by the step cache's embedder memo).
WAN_EMBEDDER_ARGS = ["timestep", "encoder_hidden_states", "encoder_hidden_states_image", "timestep_seq_len"]
# ... and the submodules both read.
WAN_EMBEDDER_PARTS = ("timesteps_proj", "time_embedder", "act_fn", "time_proj", "text_embedder")


class FusedWanConditionEmbedderHook(_model_hook_base()):
    """Replaces ``WanTimeTextImageEmbedding.forward``: the timestep chain once per distinct timestep (audited at
    the call site ``"WanTimeTextImageEmbedding"``)."""

    def new_forward(self, embedder, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    encoder_hidden_states_image: torch.Tensor | None = None, timestep_seq_len: int | None = None):
        embedder_dtype = next(iter(embedder.time_embedder.parameters())).dtype

        def embed(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            projected = embedder.timesteps_proj(values)
            if projected.dtype != embedder_dtype and embedder_dtype != torch.int8:
                projected = projected.to(embedder_dtype)
            temb = embedder.time_embedder(projected).type_as(encoder_hidden_states)
            return temb, embedder.time_proj(embedder.act_fn(temb))

        temb, timestep_proj = timestep_embedding(timestep.flatten(), embed, site="WanTimeTextImageEmbedding",
                                                 strict=self.config.strict)
        rows = (-1, timestep_seq_len) if timestep_seq_len is not None else tuple(timestep.shape)
        temb, timestep_proj = temb.unflatten(0, rows), timestep_proj.unflatten(0, rows)
        encoder_hidden_states = embedder.text_embedder(encoder_hidden_states)
        if encoder_hidden_states_image is not None:
            encoder_hidden_states_image = embedder.image_embedder(encoder_hidden_states_image)
        return temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image


def fuse_wan_condition_embedder(embedder, name: str, config: FuseKernelsConfig) -> str | None:
    """Install :class:`FusedWanConditionEmbedderHook` on a ``WanTimeTextImageEmbedding``, or return why not."""
    if not config.timestep_embedding:
        return "timestep_embedding disabled in FuseKernelsConfig"
    params = list(inspect.signature(type(embedder).forward).parameters)[1:]
    if params != WAN_EMBEDDER_ARGS:
        return f"forward takes {params}, expected {WAN_EMBEDDER_ARGS} (diffusers version changed the embedder)"
    missing = [part for part in WAN_EMBEDDER_PARTS
               if not isinstance(getattr(embedder, part, None), torch.nn.Module)]
    if missing:
        return f"no {missing} submodules; the fused forward assumes diffusers' WanTimeTextImageEmbedding"
    _register(embedder, FusedWanConditionEmbedderHook(config))
    return None
