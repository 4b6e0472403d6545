"""DeepSeek-V4's KV compressor: one compressed KV entry per ``rate`` tokens of a sequence, carried across chunks.

A building block of V4's compressed sparse attention (CSA, ``rate`` 4, overlapping windows) and heavily compressed
attention (HCA, ``rate`` 128), in the reference path and in the engine (which projects a step's tokens once and
feeds each sequence's to :meth:`KVCompressor.compress`).

Per token the compressor projects ``kv`` and a ``gate`` (``width`` values each); a closed window of ``rate`` tokens
becomes one entry ``kv_norm(sum_j softmax_j(gate_j + position_bias) * kv_j)`` (softmax over the window's tokens in
float32, per channel), rotated with the "compress" rope on its trailing ``rope_dim`` values at the absolute position
of the window's first token. CSA overlaps windows: ``width`` is ``2 * head_dim``, the first half (Ca) of window
``w - 1`` and the second half (Cb) of window ``w`` are softmaxed together into entry ``w`` (window 0 of a sequence
has no Ca part). HCA's windows do not overlap (``width`` = ``head_dim``).

State per sequence (:class:`CompressorState`): the tokens since the last closed window and the last closed
window's Ca half, so a prompt fed in chunks whose ends fall inside windows emits exactly the entries one whole
prefill emits (``tests/llm/test_kv_compressor.py`` checks this against transformers).

Source: DeepSeek-V4 paper, sections 2.3.1-2.3.2 (eqs. 9-12, 20-23); transformers 5.24 ``DeepseekV4CSACompressor``,
``DeepseekV4HCACompressor``, ``DeepseekV4Indexer`` and their caches' ``store_compression_weights`` /
``update_overlap_state`` (the correctness reference; parameter names as in its checkpoints).
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer_gen import kernels
from metainfer_gen.llm.layers.linear import ReplicatedLinear
from metainfer_gen.llm.layers.norm import RMSNorm


class CompressorState:
    """What one sequence's compressor carries between chunks (plain tensors, no device work of its own).

    Attributes:
        kv, gate: (n < rate, width) projected tokens since the last closed window.
        prior_kv, prior_gate: (rate, width / 2) Ca half of the last closed window (CSA only), or None.
        num_entries: entries emitted so far; the next window starts at token ``num_entries * rate``.
    """

    __slots__ = ("kv", "gate", "prior_kv", "prior_gate", "num_entries")

    def __init__(self) -> None:
        self.kv = self.gate = self.prior_kv = self.prior_gate = None
        self.num_entries = 0


class KVCompressor(nn.Module):
    """Compress a sequence's tokens into one entry per ``rate`` of them.

    Args:
        hidden_size: width of the layer input.
        head_dim: width of an entry (V4: 512 for attention, ``index_head_dim`` for the indexer's own compressor).
        rate: tokens per entry (``compress_rates``: 4 for CSA, 128 for HCA).
        overlap: CSA's overlapping windows (projections ``2 * head_dim`` wide).
        rope_dim: trailing values of an entry that are rotated.
        eps: ``rms_norm_eps``.
    Raises:
        ValueError: ``rope_dim`` odd or above ``head_dim``, or ``rate`` < 1.
    """

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, rope_dim: int, eps: float):
        super().__init__()
        if rate < 1 or rope_dim % 2 or not 0 < rope_dim <= head_dim:
            raise ValueError(f"need rate >= 1 and an even rope_dim in (0, head_dim={head_dim}]; got rate={rate}, "
                             f"rope_dim={rope_dim}")
        self.head_dim, self.rate, self.overlap, self.rope_dim = head_dim, rate, overlap, rope_dim
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = ReplicatedLinear(hidden_size, width)
        self.gate_proj = ReplicatedLinear(hidden_size, width)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, state: CompressorState, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
        """Feed the next tokens of one sequence.

        Args:
            x: (T, hidden) the sequence's next T tokens, in order.
            state: the sequence's state, updated in place.
            cos, sin: (positions, rope_dim / 2) float32 "compress" rope tables covering every window start.
        Returns:
            (W, head_dim) in ``x.dtype``: the entries of the windows these tokens close (W may be 0).
        """
        return self.compress(self.kv_proj(x), self.gate_proj(x), state, cos, sin)

    def compress(self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` after the projections (the engine projects every sequence's tokens in one batch):
        kv, gate (T, width) of one sequence's next T tokens -> (W, head_dim) entries of the windows they close."""
        if state.kv is not None:
            kv, gate = torch.cat([state.kv, kv]), torch.cat([state.gate, gate])
        usable = kv.shape[0] // self.rate * self.rate
        state.kv, state.gate = kv[usable:].clone(), gate[usable:].clone()  # a view would hold the step's projection
        num_windows = usable // self.rate
        if not num_windows:
            return kv.new_zeros(0, self.head_dim)
        kv = kv[:usable].view(num_windows, self.rate, -1)
        gate = gate[:usable].view(num_windows, self.rate, -1) + self.position_bias
        if self.overlap:
            kv, gate = self._overlap(kv, gate, state)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))  # (W, head_dim)
        first = state.num_entries
        state.num_entries += num_windows
        positions = torch.arange(first, first + num_windows, device=kv.device) * self.rate
        return self._rotate(entries, cos[positions], sin[positions])

    def _overlap(self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState):
        """(W, rate, 2 D) windows -> (W, 2 rate, D): window w-1's Ca rows then window w's Cb rows; window 0 takes
        the state's prior Ca (zero kv and -inf gate, so softmax weight 0, for a sequence's first window)."""
        d, rate = self.head_dim, self.rate
        ca_kv = torch.cat([kv.new_zeros(1, rate, d) if state.prior_kv is None else state.prior_kv[None],
                           kv[:-1, :, :d]])
        ca_gate = torch.cat([gate.new_full((1, rate, d), float("-inf")) if state.prior_gate is None
                             else state.prior_gate[None], gate[:-1, :, :d]])
        state.prior_kv, state.prior_gate = kv[-1, :, :d].clone(), gate[-1, :, :d].clone()
        return torch.cat([ca_kv, kv[..., d:]], dim=1), torch.cat([ca_gate, gate[..., d:]], dim=1)

    def _rotate(self, entries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Interleaved rope on the trailing ``rope_dim`` values of (W, head_dim) entries, in float32 (V4's
        ``apply_rotary_pos_emb``)."""
        nope, rope = entries.split([self.head_dim - self.rope_dim, self.rope_dim], dim=-1)
        rope = kernels.rope(rope.float().unsqueeze(1).contiguous(), cos, sin, interleaved=True,
                            site="llm.v4.compressor").squeeze(1)
        return torch.cat([nope, rope.to(entries.dtype)], dim=-1)
