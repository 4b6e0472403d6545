"""Gate-aware residuals for Wan-style blocks: reuse the modules' outputs, apply the current step's gates.

A Wan block (diffusers ``WanTransformerBlock``) adds three module outputs to its input::

    x = x + gate_msa(t) * attn1(...)      # self-attention, gated by the timestep modulation
    x = x + attn2(...)                    # cross-attention, ungated
    x = x + c_gate_msa(t) * ffn(...)      # feed-forward, gated

with ``(shift, scale, gate, c_shift, c_scale, c_gate) = scale_shift_table + temb`` (``temb`` per sample, or per
token for Wan 2.2 TI2V). The gates follow the timestep exactly, whereas the module outputs drift slowly, so
extrapolating the module outputs and multiplying by this step's gates predicts the blocks' residual better than
extrapolating the gated sum: this is why TaylorSeer (Liu et al. 2025, arXiv:2503.06923; diffusers
``hooks/taylorseer_cache.py``) predicts per module. TaylorSeer then still runs every block's norms and modulation
on a predicted step; here the residual is assembled directly, ``sum_l gate_l(t) * A_l + C_l + c_gate_l(t) * F_l``,
from three summed tensors (see :meth:`GatedBlocks.take_capture`), so a reused step costs a few elementwise
products whatever the number of blocks. Measured (``benchmarks/step_cache.py``, README): on the random-initialised
Wan 4x384, on the very steps TaylorSeer computes, 63.5 dB against the uncached clip (TaylorSeer: 63.5; the gated
sum extrapolated: 55.5); on the embedded model, whose gates move little from step to step, the gain is within noise.

Blocks that do not have this structure keep the plain residual (the step cache's generic path).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from diffusers.hooks.hooks import ModelHook

from metainfer_gen.video.fuse.wan import WAN_BLOCK_ARGS

CAPTURE_HOOK = "metainfer_step_cache_capture"
MODULES = ("attn1", "attn2", "ffn")  # in execution order; attn2 (cross-attention) is the ungated one


class _Capture(ModelHook):
    """Appends the module's output to ``sink.outputs`` while ``sink.outputs`` is a list (computed steps)."""

    _is_stateful = False

    def __init__(self, sink: "GatedBlocks"):
        super().__init__()
        self.sink = sink

    def new_forward(self, module, *args, **kwargs):
        output = self.fn_ref.original_forward(*args, **kwargs)
        if self.sink.outputs is not None:
            self.sink.outputs.append(output)
        return output


@dataclass(eq=False)
class GatedBlocks:
    """The gate tables of a run of Wan-style blocks and the capture of their module outputs.

    Attributes:
        tables: each block's ``scale_shift_table`` (1, 6, N).
        outputs: module outputs captured during the current computed step (3 per block, in order), or None when
            not capturing.
    """

    tables: list[torch.Tensor]
    outputs: list[torch.Tensor] | None = None

    @classmethod
    def of(cls, blocks: list[torch.nn.Module]) -> "GatedBlocks | None":
        """The gated layout of ``blocks`` with capture hooks installed, or None when any block lacks it."""
        from diffusers.hooks import HookRegistry

        for block in blocks:
            table = getattr(block, "scale_shift_table", None)
            params = list(inspect.signature(type(block).forward).parameters)[1:5]
            if params != WAN_BLOCK_ARGS or not isinstance(table, torch.Tensor) or table.ndim != 3 \
                    or table.shape[:2] != (1, 6) or not all(isinstance(getattr(block, m, None), torch.nn.Module)
                                                             for m in MODULES):
                return None
        gated = cls([block.scale_shift_table for block in blocks])
        for block in blocks:
            for name in MODULES:
                HookRegistry.check_if_exists_or_initialize(getattr(block, name)).register_hook(_Capture(gated),
                                                                                                CAPTURE_HOOK)
        return gated

    def start_capture(self) -> None:
        self.outputs = []

    def take_capture(self, skip_blocks: int) -> list[torch.Tensor] | None:
        """Stop capturing and sum up the module outputs of the blocks after the first ``skip_blocks``, or None
        when the capture is incomplete (a block that ran outside the hooks).

        Returns:
            ``[P, Q, R]`` (float32, each (B, S, N)) with ``P = sum_l table_l[2] * attn1_l + attn2_l +
            table_l[5] * ffn_l``, ``Q = sum_l attn1_l``, ``R = sum_l ffn_l``: since every gate is its block's
            table row plus the same ``temb`` row, the residual at any step is ``P + temb[2] * Q + temb[5] * R``
            (:meth:`residual`), and the summary, being linear in the outputs, extrapolates like them.
        """
        outputs, self.outputs = self.outputs, None
        if outputs is None or len(outputs) != len(MODULES) * len(self.tables):
            return None
        total = attn1_sum = ffn_sum = None
        for index, table in enumerate(self.tables[skip_blocks:], start=skip_blocks):
            attn1, attn2, ffn = (o.float() for o in outputs[len(MODULES) * index:len(MODULES) * (index + 1)])
            table = table.float()
            term = attn1 * table[:, 2] + attn2 + ffn * table[:, 5]
            total = term if total is None else total + term
            attn1_sum = attn1 if attn1_sum is None else attn1_sum + attn1
            ffn_sum = ffn if ffn_sum is None else ffn_sum + ffn
        return [total, attn1_sum, ffn_sum]

    @staticmethod
    def residual(temb: torch.Tensor, summary: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The blocks' residual at this step's gates, ``P + temb[2] * Q + temb[5] * R``, in ``dtype``.

        Args:
            temb: the blocks' ``temb`` argument, (B, 6, N) or (B, S, 6, N) (one timestep per token).
            summary: ``[P, Q, R]`` from :meth:`take_capture` (possibly extrapolated).
        """
        total, attn1_sum, ffn_sum = summary
        rows = temb.float().unsqueeze(1) if temb.ndim == 3 else temb.float()  # (B, 1 or S, 6, N)
        return torch.addcmul(torch.addcmul(total, rows[:, :, 2], attn1_sum), rows[:, :, 5], ffn_sum).to(dtype)
