"""Fuser for Wan's rotary position tables: built once per token grid instead of on every transformer call.

``WanRotaryPosEmbed.forward(hidden_states)`` (diffusers ``transformer_wan.py`` at 0.42.1) slices its fixed
``freqs_cos`` / ``freqs_sin`` buffers to the token grid (latent frames, height and width over the patch size),
broadcasts the time, height and width parts over the grid and concatenates them into two (1, S, 1, head_dim)
float tables. It does so on every transformer call (twice per step with CFG), although the tables depend on the
grid alone: on the embedded model that is 0.26 ms of a 2-3 ms reused step-cache call on this CPU (one thread).
The hook returns the tables it built for the same grid and the same buffers; the key holds the buffers' storage
and version counter, so moving the model (``.to()``) or editing the buffers in place builds them anew. It keeps
the last :data:`MAX_GRIDS` grids. Treat the returned tables as read-only (diffusers' attention only reads them).
"""

from __future__ import annotations

import torch

from metainfer_gen.video.fuse.core import FuseKernelsConfig
from metainfer_gen.video.fuse.wan import _model_hook_base, _register

__all__ = ["MAX_GRIDS", "MemoWanRotaryTableHook", "fuse_wan_rotary_table"]

MAX_GRIDS = 4  # token grids whose tables are kept (a call alternates at most between a few sizes)


class MemoWanRotaryTableHook(_model_hook_base()):
    """Replaces ``WanRotaryPosEmbed.forward``: the (cos, sin) tables of a grid, built by the original forward on
    the first call with that grid and buffers."""

    def __init__(self, config: FuseKernelsConfig):
        super().__init__(config)
        self.tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def new_forward(self, rope, hidden_states: torch.Tensor):
        key = (tuple(hidden_states.shape[2:]),) + tuple(
            (buffer.device, buffer.dtype, buffer.data_ptr(), buffer._version)
            for buffer in (rope.freqs_cos, rope.freqs_sin))
        tables = self.tables.get(key)
        if tables is None:
            tables = self.fn_ref.original_forward(hidden_states)
            if len(self.tables) >= MAX_GRIDS:
                self.tables.pop(next(iter(self.tables)))
            self.tables[key] = tables
        return tables


def fuse_wan_rotary_table(rope, name: str, config: FuseKernelsConfig) -> str | None:
    """Install :class:`MemoWanRotaryTableHook` on a ``WanRotaryPosEmbed``, or return why not."""
    if not config.rope_table:
        return "rope_table disabled in FuseKernelsConfig"
    buffers = [getattr(rope, name, None) for name in ("freqs_cos", "freqs_sin")]
    if not all(isinstance(buffer, torch.Tensor) for buffer in buffers) or not hasattr(rope, "patch_size"):
        return "no freqs_cos/freqs_sin buffers or patch_size; the memo assumes diffusers' WanRotaryPosEmbed"
    _register(rope, MemoWanRotaryTableHook(config))
    return None
