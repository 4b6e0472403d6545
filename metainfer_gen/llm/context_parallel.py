"""Context parallelism for one long prefill: each rank takes a share of the prompt's tokens, the cache rows
travel round a ring of ranks, and every rank attends its queries to every block it sees (ring attention).

    cp = ContextParallel.from_env()            # under torchrun / spawned ranks: gloo on the CPU
    result = cp_prefill(model, prompt_ids, cp)  # first greedy token + the whole prompt's cache rows per layer
    caches, table = to_decode_layout(result.latents, block_size=16, num_blocks=..., dtype=...)  # a bare model
    first = adopt_prefill(engine, prompt_ids, result, params)  # or: into an engine, any TP size, which decodes

Token split: the prompt is cut into 2 * size chunks and rank r takes chunks r and 2 * size - 1 - r (the "zigzag"
of Megatron-LM / Llama 3 context parallelism), so causal work is balanced. Per layer each rank projects its own
tokens (q, cache row), then for size steps works on the block it holds and passes it on (isend/irecv to the
neighbours, overlapped with the work on the current block). Ring Attention: Liu et al. 2023, arXiv:2310.01889.

- MLA (DeepSeek-V3): the block is the latent rows ``[c_kv, k_pe]``; each rank attends in the expanded form, per
  query tile over the keys the tile can see (the ``block_attention`` kernel: bf16 bmm blocks or PyTorch's fused
  CPU flash kernel, each returning the log-sum-exp), and merges partial results by log-sum-exp (online softmax),
  so no rank holds all scores.
- DSA (DeepSeek-V3.2, sparse top-k): a query may only attend to the ``index_topk`` keys the lightning indexer
  ranks highest over its *whole* causal prefix, which spans every rank. So the layer runs two rings: the first
  carries the indexer keys, and each rank keeps a running top-k (scores and positions) per query, merging each
  block's candidates; once every block has passed, the selection is the one a single rank would take over the full
  prefix. The second ring carries the latent rows and each query attends, in MLA's absorbed form as the engine's
  sparse kernel does, to those of its selected positions that lie in the block (online-softmax merge again).
  The first ring moves ``index_head_dim`` values per token (128 for V3.2 against 576 for the latent).
  Context parallelism for prefill with a separate decode setting is what vLLM-Ascend documents as PCP / DCP
  (prefill_context_parallel_size, decode_context_parallel_size) and SGLang offers for DSA models as
  ``--enable-nsa-prefill-context-parallel``.

Each CP rank holds the whole model here (CP x TP=1); MoE and o_proj run on local tokens only. After the last layer
the rows are all-gathered, so every rank holds the prompt's full cache rows, which is what any TP decode layout
needs: MLA's cache row is shared by all heads and replicated over TP ranks (see
:mod:`metainfer_gen.llm.layers.mla`). ``adopt_prefill`` writes them into an engine's paged pool; that engine runs
with its own ``tensor_parallel_size``. Not done: FP8 rows on the ring (rows travel as float32), CP inside the
engine's scheduler (this is a standalone prefill path the engine adopts), and a CP x TP grid sharing one model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metainfer_gen import kernels
from metainfer_gen.llm.layers.online_softmax import LSEMerge, block_attention, softmax_parts


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
    (L, row) cache rows of the whole prompt in position order (after the all-gather), ``row`` being the model's
    ``cache_row_size``: ``[c_kv, k_pe]`` for DeepSeek-V3, ``[c_kv, k_pe, indexer key]`` for V3.2."""

    first_token: int
    logits: torch.Tensor
    latents: list[torch.Tensor]


_PAD_POSITION = 2**24 - 1  # position of padding rows: above every query, exact in float32


def _ring_step(block: torch.Tensor, cp: ContextParallel):
    """Start passing ``block`` to the next rank and receiving the previous rank's; returns (recv buffer, works)."""
    import torch.distributed as dist

    recv = torch.empty_like(block)
    ops = [dist.P2POp(dist.isend, block, (cp.rank + 1) % cp.size),
           dist.P2POp(dist.irecv, recv, (cp.rank - 1) % cp.size)]
    return recv, dist.batch_isend_irecv(ops)


def _ring(local: torch.Tensor, pos: torch.Tensor, cp: ContextParallel, pad_to: int, visit) -> None:
    """Show every rank's ``local`` block (n, w) to ``visit(rows (k, w) in local.dtype, positions (k,) int64)``,
    own block first, while the next block is in flight.

    The block carries its positions in an extra float32 column (exact below 2**24) so one message moves both.
    Shares differ by up to a token per chunk: blocks are padded to ``pad_to`` rows at ``_PAD_POSITION``, which no
    query reaches, so positions in a block stay ascending.
    """
    block = torch.cat([local.float(), pos.float()[:, None]], dim=-1)
    if pad_to > local.shape[0]:
        filler = torch.zeros(pad_to - local.shape[0], block.shape[1])
        filler[:, -1] = _PAD_POSITION
        block = torch.cat([block, filler])
    for step in range(cp.size):
        pending = _ring_step(block, cp) if step < cp.size - 1 else None
        visit(block[:, :-1].to(local.dtype), block[:, -1].long())
        if pending is not None:
            recv, works = pending
            for w in works:
                w.wait()
            block = recv


def _tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, tile: int):
    """``(lo, hi, end)``: query ranges ``[lo, hi)`` of at most ``tile`` and the block keys ``[:end]`` they can see.
    Queries and block positions ascend, so a tile sees a prefix of the block; a tile seeing none is skipped."""
    for lo in range(0, q_pos.shape[0], tile):
        hi = min(lo + tile, q_pos.shape[0])
        end = int(torch.searchsorted(k_pos, q_pos[hi - 1 : hi], right=True))
        if end:
            yield lo, hi, end


class _RunningTopK:
    """Per query, the ``k`` best indexer scores seen so far and their positions (-1 where fewer keys were seen).

    Merging blocks in any order gives the top-k of the union, so after every block of the causal prefix has been
    merged the selection is the one ``torch.topk`` takes over the whole prefix (up to exact ties in score).
    """

    def __init__(self, queries: int, k: int):
        self.scores = torch.full((queries, k), float("-inf"))
        self.positions = torch.full((queries, k), -1, dtype=torch.long)

    def merge(self, lo: int, hi: int, scores: torch.Tensor, positions: torch.Tensor) -> None:
        """scores (t, kb) float32, -inf for keys queries [lo, hi) may not see; positions (kb,) int64."""
        cand = torch.cat([self.scores[lo:hi], scores], dim=1)
        cand_pos = torch.cat([self.positions[lo:hi], positions.expand(hi - lo, -1)], dim=1)
        best = cand.topk(self.scores.shape[1], dim=1)
        self.scores[lo:hi] = best.values
        self.positions[lo:hi] = torch.where(torch.isinf(best.values), -1, cand_pos.gather(1, best.indices))


def _dense_attention(attn, q_nope, q_pe, pos, rows, cp, tile, pad_to) -> torch.Tensor:
    """MLA over the whole causal prefix: ring of latent rows (n, r + dr), expanded form per block (keys
    ``[k_nope, k_pe]`` per head), log-sum-exp merge. Returns (n, N, dv)."""
    heads = attn.num_heads
    state = LSEMerge((heads, q_nope.shape[0]), attn.v_head_dim)
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # (N, n, dn + dr)

    def visit(block, k_pos):
        c_kv, k_pe = block.to(q_nope.dtype).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        kv = attn.kv_b_proj(c_kv).view(-1, heads, attn.qk_nope_head_dim + attn.v_head_dim)
        k_nope, v = kv.split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
        key = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1)], dim=-1).transpose(0, 1)  # (N, k, dn + dr)
        v = v.transpose(0, 1)
        for lo, hi, end in _tiles(pos, k_pos, tile):
            # Keys up to the tile's first query are visible to all of its queries: no mask, the kernel's fast
            # case. Only the rest (the diagonal, at most a tile's width) gets a mask; the log-sum-exp merge joins
            # the two parts. One masked call over the whole prefix made a 16K single-rank prefill 1.6x slower.
            full = int(torch.searchsorted(k_pos[:end], pos[lo:lo + 1], right=True))
            for start, stop, mask in ((0, full, None), (full, end, k_pos[None, full:end] <= pos[lo:hi, None])):
                if stop > start:
                    state.update((slice(None), slice(lo, hi)),
                                 *block_attention(query[:, lo:hi], key[:, start:stop], v[:, start:stop],
                                                  attn.softmax_scale, mask))

    _ring(rows, pos, cp, pad_to, visit)
    return state.result().permute(1, 0, 2)


def _select_topk(indexer, iq, weights, pos, keys, cp, tile, pad_to) -> torch.Tensor:
    """DSA selection over the whole causal prefix: ring of indexer keys (n, D), running top-k. iq (n, H, D) and
    weights (n, H) are this rank's indexer queries. Returns (n, index_topk) int64 positions, -1 for none.

    Scores use :func:`metainfer_gen.kernels.indexer.indexer_scores_reference` (transformers' operation order), the
    values the one-rank engine's torch path ranks."""
    from metainfer_gen.kernels.indexer import indexer_scores_reference

    best = _RunningTopK(pos.shape[0], indexer.topk)

    def visit(block, k_pos):
        block = block.to(iq.dtype)[None]
        for lo, hi, end in _tiles(pos, k_pos, tile):
            visible = torch.searchsorted(k_pos[:end], pos[lo:hi], right=True)
            scores = indexer_scores_reference(iq[None, lo:hi], weights[None, lo:hi], block[:, :end], visible[None],
                                              indexer.softmax_scale)[0]  # (t, end) float32
            best.merge(lo, hi, scores, k_pos[:end])

    _ring(keys, pos, cp, pad_to, visit)
    return best.positions


def _sparse_attention(attn, q_nope, q_pe, pos, rows, picked, cp, tile, pad_to) -> torch.Tensor:
    """Sparse MLA: ring of latent rows (n, r + dr); each query attends, in the absorbed form (as
    :func:`metainfer_gen.kernels.sparse_mla`), to its ``picked`` (n, K) positions found in the block. Returns
    (n, N, dv)."""
    query = attn._absorb_query(q_nope, q_pe)  # (n, N, r + dr)
    state = LSEMerge((attn.num_heads, q_nope.shape[0]), attn.kv_lora_rank)

    def visit(block, k_pos):
        for lo, hi, end in _tiles(pos, k_pos, tile):
            want = picked[lo:hi]  # (t, K)
            at = torch.searchsorted(k_pos[:end], want.clamp_min(0)).clamp_max(end - 1)
            found = (want >= 0) & (k_pos[at] == want)
            if not bool(found.any()):
                continue
            context = block[at].to(query.dtype)  # (t, K, r + dr)
            scores = torch.einsum("tnc,tkc->ntk", query[lo:hi], context)
            scores = (scores.float() * attn.softmax_scale).masked_fill(~found[None], float("-inf"))
            state.update((slice(None), slice(lo, hi)),
                         *softmax_parts(scores, context[..., : attn.kv_lora_rank], "ntk,tkd->ntd"))

    _ring(rows, pos, cp, pad_to, visit)
    return attn._unabsorb(state.result().permute(1, 0, 2).to(q_nope.dtype))


def _layer(layer, x, pos, cos, sin, cp: ContextParallel, tile: int, pad_to: int):
    """One decoder layer on this rank's tokens; returns (x, this rank's cache rows (n, cache_row_size))."""
    attn, h = layer.self_attn, layer.input_layernorm(x)
    q_nope, q_pe, latent, q_resid = attn._project(h, cos, sin)  # the engine's projections, same numerics
    rows = latent[:, 0]  # (n, r + dr)
    indexer = getattr(attn, "indexer", None)
    if indexer is None:
        out = _dense_attention(attn, q_nope, q_pe, pos, rows, cp, tile, pad_to)
    else:
        keys = indexer.keys(h, cos, sin)  # (n, D), cached beside the latent as the engine does
        if attn.sparse:
            iq, weights = indexer.queries(h, q_resid, cos, sin)
            picked = _select_topk(indexer, iq, weights, pos, keys, cp, tile, pad_to)
            out = _sparse_attention(attn, q_nope, q_pe, pos, rows, picked, cp, tile, pad_to)
        else:
            out = _dense_attention(attn, q_nope, q_pe, pos, rows, cp, tile, pad_to)
        rows = torch.cat([rows, keys.to(rows.dtype)], dim=-1)
    x = x + attn.o_proj(out.to(x.dtype).flatten(1))
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
        model: the engine's DeepSeek-V3 or V3.2 model built with TP=1 (whole on every rank). V3.2 layers attend
            sparsely (top-k over the whole prefix) unless their ``self_attn.sparse`` is False.
        prompt: token ids, at least ``2 * cp.size`` of them.
        tile: queries per score tile (bounds the float32 scores at heads x tile x block).
    Raises:
        ValueError: a prompt shorter than ``2 * cp.size`` tokens, or a model with GLM-5 "shared" indexer layers.
    """
    if len(prompt) < 2 * cp.size:
        raise ValueError(f"a prompt of {len(prompt)} tokens cannot be split over {cp.size} ranks; need at least "
                         f"{2 * cp.size}")
    shared = [i for i, layer in enumerate(model.model.layers)
              if getattr(layer.self_attn, "sparse", False) and layer.self_attn.indexer is None]
    if shared:
        raise ValueError(f"context-parallel prefill does not carry a top-k between layers yet: layers {shared} "
                         f"share the previous layer's top-k (indexer_types 'shared'); prefill them in the engine")
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


def adopt_prefill(engine, prompt: list[int], result: PrefillResult, params=None, request_id: str | None = None):
    """Hand a context-parallel prefill to ``engine``, which decodes it with its own settings (any
    ``tensor_parallel_size``: the MLA cache row is replicated over TP ranks, and every CP rank holds all rows).

    The request is checked and refused as ``engine.add_request`` does; it then gets KV blocks for the prompt, the
    rows are written with the engine's store kernel (any cache dtype), and it joins the running batch as if its
    prefill step had just sampled ``result.first_token`` (the scheduler's own update: prefix-cache registration,
    stop checks). Step the engine (``engine.step()``) to decode; under TP every rank adopts and steps alike.

    Args:
        engine: an :class:`~metainfer_gen.llm.engine.LLMEngine` for the same checkpoint.
        prompt: the prefilled token ids. result: what :func:`cp_prefill` returned for them.
        params: :class:`~metainfer_gen.llm.sequence.SamplingParams` for the rest (the first token was greedy).
    Returns:
        the :class:`~metainfer_gen.llm.outputs.RequestOutput` of the first token (finished when that ends it).
    Raises:
        RequestRejected: as ``add_request`` (too long for the model or the pool).
        ValueError: rows that do not match the engine's layers or cache row, or a prompt of another length.
        RuntimeError: not enough free KV blocks or sequence slots now (retry when requests finish).
    """
    from metainfer_gen.llm.outputs import RequestOutput
    from metainfer_gen.llm.scheduler import ScheduledSequence, SchedulerOutput
    from metainfer_gen.llm.sequence import SequenceStatus

    caches = engine.runner.kv_caches
    if len(result.latents) != len(caches) or any(r.shape != (len(prompt), c.shape[-1])
                                                 for r, c in zip(result.latents, caches)):
        raise ValueError(f"prefill rows {[tuple(r.shape) for r in result.latents[:1]]} x {len(result.latents)} "
                         f"layers do not fit this engine: {len(prompt)} tokens x row {caches[0].shape[-1]} x "
                         f"{len(caches)} layers")
    request_id = engine.add_request(prompt, params, request_id)
    seq = engine._requests[request_id]
    scheduler, blocks = engine.scheduler, engine.block_manager
    scheduler.waiting.remove(seq)
    needed = blocks.blocks_needed(seq, len(prompt))
    if not blocks.can_allocate(needed) or len(scheduler.running) >= scheduler.max_num_seqs:
        engine._requests.pop(request_id)
        raise RuntimeError(f"cannot adopt a {len(prompt)}-token prefill now: it needs {needed} KV blocks "
                           f"({blocks.num_free_blocks} free) and a sequence slot ({len(scheduler.running)} of "
                           f"{scheduler.max_num_seqs} running)")
    blocks.allocate(seq, len(prompt))
    size = engine.config.block_size
    slots = torch.tensor([seq.block_table[i // size] * size + i % size for i in range(len(prompt))],
                         device=caches[0].device)
    for rows, cache in zip(result.latents, caches):
        kernels.store_kv_cache(rows.to(cache.device).unsqueeze(1), None, cache, None, slots, site="cp_adopt")
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)
    finished = scheduler.update(SchedulerOutput([ScheduledSequence(seq, 0, len(prompt))]),
                                {seq.seq_id: result.first_token})
    if finished:
        engine._requests.pop(request_id, None)
    return RequestOutput.from_sequence(seq, [result.first_token], engine._detokenize(seq) if finished else "")
