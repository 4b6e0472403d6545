"""Context parallelism for one long prefill: each rank takes a share of the prompt's tokens, the MLA latent rows
travel round a ring of ranks, and every rank attends its queries to every block it sees (ring attention).

    cp = ContextParallel.from_env()            # under torchrun / spawned ranks: gloo on the CPU
    result = cp_prefill(model, prompt_ids, cp)  # first greedy token + the whole prompt's latent rows per layer
    caches, table = to_decode_layout(result.latents, block_size=16, dtype=..., device=...)

Token split: the prompt is cut into 2 * size chunks and rank r takes chunks r and 2 * size - 1 - r (the "zigzag"
of Megatron-LM / Llama 3 context parallelism), so causal work is balanced. Per layer each rank projects its own
tokens (q, latent row ``[c_kv, k_pe]``), then for size steps attends to the block it holds and passes it on
(isend/irecv to the neighbours, overlapped with the attention of the current block); partial results are merged
with an online softmax (log-sum-exp), so no rank ever holds all scores. Ring Attention: arXiv:2310.01889.

Each CP rank holds the whole model here (CP x TP=1); MoE and o_proj run on local tokens only. After the last layer
the rows are all-gathered and written into the engine's paged layout for decode (``to_decode_layout``), which
decodes with its own TP setting. Not done: the DSA sparse (top-k) variant of the ring and FP8 rows, CP inside the
engine's scheduler (this is a standalone prefill path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metainfer_gen import kernels


@dataclass(frozen=True, slots=True)
class ContextParallel:
    """This rank's place in the context-parallel ring (``size`` 1 runs the same code without communication).

    Raises:
        ValueError: rank outside [0, size).
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"context-parallel rank must be in [0, {self.size}); got {self.rank}")

    @classmethod
    def from_env(cls) -> "ContextParallel":
        """Join (or reuse) the default torch.distributed group, gloo on the CPU, from torchrun's variables."""
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    def shard(self, num_tokens: int) -> torch.Tensor:
        """Positions (int64, ascending) of the prompt tokens this rank prefills: zigzag chunks r and 2s-1-r."""
        bounds = torch.linspace(0, num_tokens, 2 * self.size + 1).round().long().tolist()
        chunks = (self.rank, 2 * self.size - 1 - self.rank)
        return torch.cat([torch.arange(bounds[c], bounds[c + 1]) for c in chunks])


@dataclass(slots=True)
class PrefillResult:
    """first_token: greedy token after the prompt; logits: its (vocab,) float32 logits; latents: per layer the
    (L, r + dr) rows of the whole prompt in position order (after the all-gather)."""

    first_token: int
    logits: torch.Tensor
    latents: list[torch.Tensor]


def _ring_step(block: torch.Tensor, cp: ContextParallel):
    """Start passing ``block`` to the next rank and receiving the previous rank's; returns (recv buffer, works)."""
    import torch.distributed as dist

    recv = torch.empty_like(block)
    ops = [dist.P2POp(dist.isend, block, (cp.rank + 1) % cp.size),
           dist.P2POp(dist.irecv, recv, (cp.rank - 1) % cp.size)]
    return recv, dist.batch_isend_irecv(ops)


class _OnlineSoftmax:
    """Running max, normaliser and weighted sum of values per (head, query), float32."""

    def __init__(self, heads: int, queries: int, dv: int):
        self.m = torch.full((heads, queries), float("-inf"))
        self.l = torch.zeros(heads, queries)
        self.acc = torch.zeros(heads, queries, dv)

    def update(self, rows: slice, scores: torch.Tensor, v: torch.Tensor) -> None:
        """scores (N, t, k) float32 with -inf where masked; v (k, N, dv)."""
        m_old = self.m[:, rows]
        m_new = torch.maximum(m_old, scores.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - safe[..., None])
        scale = torch.exp(m_old - safe)
        self.l[:, rows] = self.l[:, rows] * scale + p.sum(-1)
        self.acc[:, rows] = self.acc[:, rows] * scale[..., None] + torch.einsum("ntk,knd->ntd", p, v.float())
        self.m[:, rows] = m_new

    def result(self) -> torch.Tensor:
        """(queries, N, dv)."""
        return (self.acc / self.l[..., None]).permute(1, 0, 2)


def _attend(attn, q_nope, q_pe, q_pos, rows, k_pos, state: _OnlineSoftmax, tile: int) -> None:
    """Fold one block of context rows (k, r + dr) at positions k_pos into ``state`` for every query tile."""
    c_kv, k_pe = rows.to(q_nope.dtype).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    kv = attn.kv_b_proj(c_kv).view(-1, attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim)
    k_nope, v = kv.split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
    k_first = int(k_pos.min())
    for lo in range(0, q_nope.shape[0], tile):
        hi = min(lo + tile, q_nope.shape[0])
        if int(q_pos[hi - 1]) < k_first:  # queries ascend: this tile sees none of the block (skipped)
            continue
        scores = torch.einsum("qnd,knd->nqk", q_nope[lo:hi], k_nope) + torch.einsum("qnd,kd->nqk", q_pe[lo:hi], k_pe)
        causal = k_pos[None, :] <= q_pos[lo:hi, None]
        state.update(slice(lo, hi), (scores.float() * attn.softmax_scale).masked_fill(~causal, float("-inf")), v)


def _layer(layer, x, pos, cos, sin, cp: ContextParallel, tile: int, pad_to: int):
    """One decoder layer on this rank's tokens; returns (x, this rank's latent rows (n, r + dr))."""
    attn, h = layer.self_attn, layer.input_layernorm(x)
    n = x.shape[0]
    q = attn.q_proj(h) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h)))
    q_nope, q_pe = q.view(n, attn.num_heads, -1).split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(h).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    site = f"layers.{attn.layer_idx}.self_attn"
    q_pe = kernels.rope(q_pe.contiguous(), cos, sin, interleaved=attn.rope_interleave, site=site)
    k_pe = kernels.rope(k_pe.reshape(n, 1, -1).contiguous(), cos, sin, interleaved=attn.rope_interleave, site=site)
    rows = torch.cat([attn.kv_a_layernorm(c_kv), k_pe[:, 0]], dim=-1)  # (n, r + dr)
    state = _OnlineSoftmax(attn.num_heads, n, attn.v_head_dim)
    # The block carries its positions in an extra float column (exact below 2**24) so one message moves both.
    # Shares differ by up to a token per chunk; padding rows sit at a position no query reaches.
    block = torch.cat([rows.float(), pos.float()[:, None]], dim=-1)
    if pad_to > n:
        filler = torch.zeros(pad_to - n, block.shape[1])
        filler[:, -1] = 2**24 - 1
        block = torch.cat([block, filler])
    for step in range(cp.size):
        pending = _ring_step(block, cp) if step < cp.size - 1 else None
        _attend(attn, q_nope, q_pe, pos, block[:, :-1].to(rows.dtype), block[:, -1].long(), state, tile)
        if pending is not None:
            recv, works = pending
            for w in works:
                w.wait()
            block = recv
    out = state.result().to(x.dtype)  # (n, N, dv)
    x = x + attn.o_proj(out.flatten(1))
    return x + layer.mlp(layer.post_attention_layernorm(x)), rows


def _gather(rows: torch.Tensor, pos: torch.Tensor, num_tokens: int, cp: ContextParallel) -> torch.Tensor:
    """Every rank's rows, placed by position: (num_tokens, width)."""
    full = rows.new_zeros(num_tokens, rows.shape[-1])
    if cp.size == 1:
        full[pos] = rows
        return full
    import torch.distributed as dist

    sizes = [len(ContextParallel(r, cp.size).shard(num_tokens)) for r in range(cp.size)]
    pad = max(sizes)
    mine = torch.cat([rows, rows.new_zeros(pad - rows.shape[0], rows.shape[1])])
    parts = [torch.empty_like(mine) for _ in range(cp.size)]
    dist.all_gather(parts, mine)
    for r, part in enumerate(parts):
        full[ContextParallel(r, cp.size).shard(num_tokens)] = part[: sizes[r]]
    return full


@torch.inference_mode()
def cp_prefill(model, prompt: list[int], cp: ContextParallel, tile: int = 512) -> PrefillResult:
    """Prefill ``prompt`` split over the ring; every rank returns the same result.

    Args:
        model: the engine's DeepSeek-V3 model built with TP=1 (whole on every rank).
        prompt: token ids, at least ``2 * cp.size`` of them.
        tile: queries per score tile (bounds the float32 scores at heads x tile x block).
    Raises:
        ValueError: a prompt shorter than ``2 * cp.size`` tokens.
    """
    if len(prompt) < 2 * cp.size:
        raise ValueError(f"a prompt of {len(prompt)} tokens cannot be split over {cp.size} ranks; need at least "
                         f"{2 * cp.size}")
    pos = cp.shard(len(prompt))
    pad_to = max(len(ContextParallel(r, cp.size).shard(len(prompt))) for r in range(cp.size))
    x = model.model.embed_tokens(torch.tensor(prompt)[pos])
    cos, sin = model.model.rotary(pos)
    latents = []
    for layer in model.model.layers:
        x, rows = _layer(layer, x, pos, cos, sin, cp, tile, pad_to)
        latents.append(rows)
    hidden = model.model.norm(x)
    # The rank whose share ends the prompt (rank 0 with the zigzag) holds the last token; a sum puts it everywhere.
    holds_last = int(pos[-1]) == len(prompt) - 1
    last = hidden[-1:].float() if holds_last else hidden.new_zeros(1, hidden.shape[1], dtype=torch.float32)
    if cp.size > 1:
        import torch.distributed as dist

        dist.all_reduce(last)
    logits = model.compute_logits(last.to(hidden.dtype))[0].float()
    full = [_gather(rows, pos, len(prompt), cp) for rows in latents]
    return PrefillResult(first_token=int(logits.argmax()), logits=logits, latents=full)


def to_decode_layout(latents: list[torch.Tensor], block_size: int, num_blocks: int, dtype: torch.dtype,
                     device: torch.device | str = "cpu") -> tuple[list[torch.Tensor], list[int]]:
    """Paged caches (num_blocks, block_size, 1, row) per layer holding the prompt in blocks 0.., and that block
    table: the layout :class:`~metainfer_gen.llm.model_runner.ModelRunner` decodes from.

    Raises:
        ValueError: the pool is too small for the prompt.
    """
    length, row = latents[0].shape
    needed = -(-length // block_size)
    if needed > num_blocks:
        raise ValueError(f"{length} tokens need {needed} blocks of {block_size}; the pool has {num_blocks}")
    caches = []
    for rows in latents:
        cache = torch.zeros(num_blocks, block_size, 1, row, dtype=dtype, device=device)
        cache.view(-1, row)[:length] = rows.to(dtype)
        caches.append(cache)
    return caches, list(range(num_blocks))
