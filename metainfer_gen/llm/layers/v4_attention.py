"""DeepSeek-V4 attention, non-paged reference path: one sequence at a time, its state carried between calls.

Every layer attends over one 512-wide shared K=V head: the last ``sliding_window`` tokens (a causal window), plus,
on compressed layers, the compressor's entries that are complete before the query (entry ``e`` covers tokens
``[e r, (e + 1) r)``). ``compressed_sparse_attention`` (CSA, r = 4) keeps only the ``index_topk`` entries its
lightning indexer scores highest (the indexer compresses its own keys at ``index_head_dim``);
``heavily_compressed_attention`` (HCA, r = 128) sees all of them; ``sliding_attention`` none. Queries go through a
q LoRA and an unweighted per-head RMSNorm; rope is partial (the trailing ``rope_dim`` values, interleaved pairs;
"main" tables on sliding layers, "compress" on compressed ones) and is undone on the output (conjugate rotation at
the query's position) before the grouped low-rank output projection (``o_groups`` blocks to ``o_lora_rank`` each,
then ``o_b_proj``). A learned per-head sink logit joins each softmax.

Here the window and the entries live in per-sequence tensors (:class:`AttentionState`), one sequence at a time; the
engine's paged, batched form of the same computation is :mod:`metainfer_gen.llm.layers.v4_paged_attention`. Tensor
parallelism splits the heads (``q_b_proj`` column-parallel, ``sinks``) and whole output groups (``o_a_proj``'s
blocks, ``o_b_proj`` row-parallel with one all-reduce); the K=V head, compressors and indexer are replicated
(:mod:`metainfer_gen.llm.models.v4_tensor_parallel`). Not yet: FP8. Source: DeepSeek-V4 paper section 2.3;
transformers 5.24 ``DeepseekV4Attention``, ``DeepseekV4Indexer``, ``eager_attention_forward`` (the correctness
reference).
"""

from __future__ import annotations

import torch
from torch import nn

from metainfer_gen import kernels
from metainfer_gen.llm.layers.hyper_connection import unweighted_rms_norm
from metainfer_gen.llm.layers.kv_compressor import CompressorState, KVCompressor
from metainfer_gen.llm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from metainfer_gen.llm.layers.norm import RMSNorm
from metainfer_gen.llm.parallel import Shard, TensorParallel

_COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope on the trailing ``2 * cos.shape[-1]`` values of x (T, H, D), in float32, result in
    ``x.dtype``; cos/sin (T, rope_dim / 2)."""
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x.split([x.shape[-1] - rope_dim, rope_dim], dim=-1)
    rope = kernels.rope(rope.float().contiguous(), cos, sin, interleaved=True, site="llm.v4.attention")
    return torch.cat([nope, rope.to(x.dtype)], dim=-1)


class AttentionState:
    """One sequence's state in one layer: the last ``sliding_window - 1`` keys (K = V), and on compressed layers
    the compressor states and every entry emitted so far (attention entries (W, D), indexer keys (W, D_i))."""

    __slots__ = ("window", "compressor", "entries", "indexer", "index_keys")

    def __init__(self) -> None:
        self.window = self.entries = self.index_keys = None
        self.compressor, self.indexer = CompressorState(), CompressorState()

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this state holds (the compressors' buffers included)."""
        tensors = [self.window, self.entries, self.index_keys]
        for c in (self.compressor, self.indexer):
            tensors += [c.kv, c.gate, c.prior_kv, c.prior_gate]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class IndexerScorer(nn.Module):
    """``weights_proj`` (hidden -> index heads), named as in the checkpoint (``indexer.scorer.weights_proj``)."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.weights_proj = ReplicatedLinear(hidden_size, num_heads)


class Indexer(KVCompressor):
    """CSA's lightning indexer: its own overlapping compressor at ``index_head_dim`` plus query heads; replicated
    on every tensor-parallel rank (its heads are summed into one score per entry before the top-k).

    Scores ``sum_h w_h relu(q_h . k) / sqrt(D_i)`` with ``w = weights_proj(x) / sqrt(H_i)``, in float32."""

    def __init__(self, config, rope_dim: int):
        super().__init__(config.hidden_size, config.index_head_dim, config.compress_rates[_COMPRESSED[0]], True,
                         rope_dim, config.rms_norm_eps)
        self.num_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.scorer = IndexerScorer(config.hidden_size, self.num_heads)

    def select(self, x, q_resid, keys, positions, cos, sin) -> torch.Tensor:
        """(T, W) bool: the entries each query attends to (its top-k among those complete before it)."""
        return self.pick(*self.queries(x, q_resid, cos, sin), keys, positions)

    def queries(self, x, q_resid, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden), q_resid (T, q_lora_rank), cos/sin (T, rope_dim / 2) "compress" rope at the queries'
        positions -> (q (T, H_i, D_i) in x's dtype, head weights (T, H_i) float32)."""
        q = rotate_tail(self.q_b_proj(q_resid).view(x.shape[0], self.num_heads, self.head_dim), cos, sin)
        return q, self.scorer.weights_proj(x).float() * self.num_heads ** -0.5

    def pick(self, q, weights, keys, positions) -> torch.Tensor:
        """:meth:`select` from :meth:`queries`' output: keys (W, D_i) of entries 0 .. W - 1, positions (T,)
        -> (T, W) bool."""
        picked, valid = self.top_entries(q, weights, keys, positions)
        return torch.zeros(q.shape[0], keys.shape[0], dtype=torch.bool, device=q.device).scatter_(1, picked, valid)

    def scores(self, q, weights, keys) -> torch.Tensor:
        """q (T, H_i, D_i), weights (T, H_i) float32, keys (W, D_i) -> (T, W) float32 scores."""
        scores = torch.relu(q.float() @ keys.float().T) * self.head_dim ** -0.5  # (T, H_i, W)
        return (scores * weights.unsqueeze(-1)).sum(dim=1)

    def top_entries(self, q, weights, keys, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`pick` as indices: (picked (T, min(topk, W)) int64 entry ids, valid (T, min(topk, W)) bool: the
        entry is complete before the query). Each row's scores and top-k depend on that row alone (the top-k sees
        the whole row, so exact ties at 0 break as in one call over every query), so rows may come in tiles."""
        scores = self.scores(q, weights, keys)
        complete = ((positions + 1) // self.rate)[:, None]
        visible = torch.arange(keys.shape[0], device=q.device)[None] < complete
        picked = scores.masked_fill(~visible, float("-inf")).topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return picked, picked < complete


class CSACompressor(KVCompressor):
    """The CSA compressor (rate 4, overlapping windows) with its indexer (checkpoint ``compressor.indexer.*``);
    replicated on every tensor-parallel rank (its entries are per token, shared by every head)."""

    def __init__(self, config, rope_dim: int):
        super().__init__(config.hidden_size, config.head_dim, config.compress_rates[_COMPRESSED[0]], True, rope_dim,
                         config.rms_norm_eps)
        self.indexer = Indexer(config, rope_dim)


class V4Attention(nn.Module):
    """One V4 attention layer; ``config`` is a transformers ``DeepseekV4Config``.

    Under tensor parallelism ``tp`` a rank holds ``num_heads / size`` heads and ``o_groups / size`` whole output
    groups (``num_heads`` and ``o_groups`` are then this rank's counts); the K=V head (``kv_proj``, ``kv_norm``),
    the q LoRA's first half (``q_a_proj``, ``q_a_norm``: the indexer reads its output) and the compressor are
    replicated; ``o_b_proj`` sums the ranks' outputs.

    Raises:
        ValueError: an unknown ``layer_types`` entry, heads not divisible into ``o_groups``, or heads / groups
            not divisible by the tensor-parallel size.
    """

    def __init__(self, config, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        tp = tp or TensorParallel.single()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type not in ("sliding_attention", *_COMPRESSED):
            raise ValueError(f"layer_types[{layer_idx}] = {self.layer_type!r} is not a DeepSeek-V4 attention type")
        if config.num_attention_heads * config.head_dim % config.o_groups:
            raise ValueError(f"{config.num_attention_heads} heads x {config.head_dim} do not split into "
                             f"o_groups={config.o_groups}")
        self.rope_type = "main" if self.layer_type == "sliding_attention" else "compress"
        heads, groups = config.num_attention_heads, config.o_groups
        self.num_heads, self.o_groups = tp.split(heads, "num_attention_heads"), tp.split(groups, "o_groups")
        self.head_dim, self.window, self.eps = config.head_dim, config.sliding_window, config.rms_norm_eps
        rope_dim = int(self.head_dim * config.rope_parameters[self.rope_type].get("partial_rotary_factor", 1.0))
        hidden, q_rank = config.hidden_size, config.q_lora_rank
        self.q_a_proj = ReplicatedLinear(hidden, q_rank)
        self.q_a_norm = RMSNorm(q_rank, config.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(q_rank, heads * self.head_dim, tp=tp)
        self.kv_proj = ReplicatedLinear(hidden, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # block-diagonal, one (o_lora_rank, N D / g) block a group: a rank's rows are its own groups' blocks
        self.o_a_proj = ColumnParallelLinear(heads * self.head_dim // groups, groups * config.o_lora_rank, tp=tp)
        self.o_b_proj = RowParallelLinear(groups * config.o_lora_rank, hidden, tp=tp)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        if tp.enabled:
            self.sinks.tp_shard = Shard(0, tp.rank * self.num_heads, self.num_heads, heads)
        self.compressor = None
        if self.layer_type == _COMPRESSED[0]:
            self.compressor = CSACompressor(config, rope_dim)
        elif self.layer_type == _COMPRESSED[1]:
            self.compressor = KVCompressor(hidden, self.head_dim, config.compress_rates[_COMPRESSED[1]], False,
                                           rope_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: AttentionState, tables: dict
                ) -> torch.Tensor:
        """x (T, hidden): the sequence's next T tokens at ``positions`` (T,) (consecutive, after every token
        ``state`` has seen); tables: {"main"/"compress": (cos, sin) (max_positions, rope_dim / 2)}. -> (T, hidden)."""
        cos, sin = (t[positions] for t in tables[self.rope_type])
        q, q_resid, kv = self.project(x, cos, sin)
        keys = kv if state.window is None else torch.cat([state.window, kv])
        state.window = keys[-(self.window - 1):] if self.window > 1 else keys[:0]
        key_pos = torch.arange(int(positions[-1]) + 1 - keys.shape[0], int(positions[-1]) + 1, device=x.device)
        visible = (key_pos[None] <= positions[:, None]) & (key_pos[None] > positions[:, None] - self.window)
        if self.compressor is not None:
            entries, entry_visible = self._compressed(x, q_resid, positions, state, tables["compress"])
            keys, visible = torch.cat([keys, entries]), torch.cat([visible, entry_visible], dim=1)
        return self.project_out(self._attend(q, keys, visible), cos, sin)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, hidden), cos/sin (T, rope_dim / 2) of this layer's rope at the tokens' positions -> (q (T, N, D)
        normed and rotated, q_resid (T, q_lora_rank) for the indexer, the shared K=V row kv (T, D) rotated)."""
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(x.shape[0], self.num_heads, self.head_dim)
        q = rotate_tail(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)).unsqueeze(1), cos, sin)[:, 0]
        return q, q_resid, kv

    def project_out(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output (T, N, D) -> (T, hidden): rope undone at the queries' positions, then the grouped
        low-rank projection."""
        out = rotate_tail(out, cos, -sin).view(out.shape[0], self.o_groups, -1)
        weight = self.o_a_proj.weight.view(self.o_groups, -1, out.shape[-1])  # (g, o_lora_rank, N D / g)
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", out, weight.to(out.dtype)).flatten(1))

    def _compressed(self, x, q_resid, positions, state: AttentionState, compress_tables):
        """(all entries so far (W, D), (T, W) which ones each query sees)."""
        new = self.compressor(x, state.compressor, *compress_tables)
        state.entries = new if state.entries is None else torch.cat([state.entries, new])
        rate = self.compressor.rate
        if isinstance(self.compressor, CSACompressor):
            indexer = self.compressor.indexer
            new_keys = indexer(x, state.indexer, *compress_tables)
            state.index_keys = new_keys if state.index_keys is None else torch.cat([state.index_keys, new_keys])
            cos, sin = (t[positions] for t in compress_tables)
            return state.entries, indexer.select(x, q_resid, state.index_keys, positions, cos, sin)
        index = torch.arange(state.entries.shape[0], device=x.device)
        return state.entries, index[None] < ((positions + 1) // rate)[:, None]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                selected: torch.Tensor | None = None, selected_valid: torch.Tensor | None = None) -> torch.Tensor:
        """q (T, N, D) over keys = values (L, D) where ``visible`` (T, L), and, when given, over each query's own
        ``selected`` keys = values (T, k, D) where ``selected_valid`` (T, k) (CSA's top-k entries, gathered: the
        same softmax as masking every other entry out, without a (T, N, W) score over all W entries); a sink logit
        per head joins the softmax and takes its share of the weight, then is dropped. -> (T, N, D)."""
        scores = torch.einsum("tnd,ld->tnl", q, keys) * self.head_dim ** -0.5
        parts = [scores.masked_fill(~visible[:, None], float("-inf"))]
        if selected is not None:
            own = torch.einsum("tnd,tkd->tnk", q, selected) * self.head_dim ** -0.5
            parts.append(own.masked_fill(~selected_valid[:, None], float("-inf")))
        parts.append(self.sinks.to(scores.dtype).view(1, -1, 1).expand(scores.shape[0], -1, 1))
        logits = torch.cat(parts, dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        out = torch.einsum("tnl,ld->tnd", probs[..., :keys.shape[0]].to(keys.dtype), keys)
        if selected is None:
            return out
        return out + torch.einsum("tnk,tkd->tnd", probs[..., keys.shape[0]:].to(selected.dtype), selected)
