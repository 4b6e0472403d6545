"""Peak activation bytes of one engine step from a model's dimensions alone: a prefill chunk at a given context,
a decode batch at a given context, and the worse of the two (what KV sizing must leave free).

Plain Python (no torch), read by :mod:`metainfer_gen.llm.plan` and checked against the engine's measured peaks
(``tests/llm/test_kv_sizing.py``, within 10%). The attention terms follow the blockwise paths
(:mod:`metainfer_gen.llm.layers.mla_prefill`, :mod:`metainfer_gen.kernels.paged_mla`): they read the context a
chunk at a time (:mod:`metainfer_gen.llm.attention_chunks`), so past one chunk they stop growing with it; the
"materialised" mode is the whole-context path the engine ran before (scores for every context token at once).
"""

from __future__ import annotations

from metainfer_gen.llm.attention_chunks import QUERY_BLOCK, absorbed_is_cheaper, decode_group_tokens, key_chunk
from metainfer_gen.llm.plan_model import ModelDims

__all__ = ["ATTENTION_MODES", "decode_activation_bytes", "prefill_activation_bytes", "worst_step_activation_bytes"]

ATTENTION_MODES = ("blockwise", "fused", "materialised")


def _projections(d: ModelDims, n: float, heads: float) -> float:
    """Values alive per layer for n new tokens while attention runs: q, the rotated q_pe, the cache row, the
    per-head output (and the indexer's queries)."""
    qk = d.qk_nope + d.qk_rope
    values = n * (heads * (qk + d.qk_rope + d.v_head) + d.latent_row)
    return values + (n * d.index_n_heads * d.index_head_dim if d.index_head_dim else 0)


def _mlp_moe(d: ModelDims, n: float, attn_tp: int, b: int) -> float:
    """Bytes of the dense MLP or the routed + shared experts for n tokens, whichever is larger."""
    mlp = 3 * n * d.intermediate / attn_tp * b
    if not d.num_experts:
        return mlp
    # (token, expert) pairs landing on this rank: every rank of a group sees the group's n tokens, and the groups'
    # tokens spread over all expert ranks: n * k * groups / expert_ranks = n * k / attn_tp.
    local = n * d.top_k / attn_tp
    moe = b * (n * d.hidden + 3 * n * d.moe_intermediate * d.num_shared_experts / attn_tp +
               local * (2 * d.hidden + 3 * d.moe_intermediate)) + 8 * n * d.num_experts
    return max(mlp, moe)


def prefill_activation_bytes(d: ModelDims, num_tokens: int, context: int, attn_tp: int, expert_ranks: int,
                             act_bytes: int = 2, attention: str = "blockwise") -> float:
    """Peak bytes of live activations on one rank while it prefills ``num_tokens`` new tokens of one sequence
    that attend over ``context`` cached tokens (context includes them).

    Args:
        attention: "blockwise" (the engine: the context in chunks of
            :func:`~metainfer_gen.llm.attention_chunks.key_chunk` rows, absorbed or expanded as the engine picks;
            a block of 128 queries' scores at a time), "fused" (flash-style GPU kernels over the
            whole expanded context, scores never materialised, as vLLM's MLA prefill) or "materialised" (the
            engine's earlier path: three float32 score tensors of (heads, tokens, context) alive at once).
        act_bytes: bytes per activation value (2 for bf16, 4 for the CPU's float32).
        expert_ranks: ranks the routed experts are spread over (the MoE term follows the tensor-parallel split).
    Raises:
        ValueError: unknown attention mode.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}; got {attention!r}")
    n, b = num_tokens, act_bytes
    heads = d.num_heads / attn_tp
    dq, width = d.qk_nope + d.qk_rope, max(d.qk_nope + d.qk_rope, d.v_head)
    attn = _projections(d, n, heads) * b
    if d.index_head_dim:
        attn += n * context * 4  # the indexer's (n, context) float32 scores
    if attention == "blockwise":
        chunk = min(context, key_chunk(round(heads), n))
        masked = min(n, chunk)  # queries on the diagonal of a chunk get a bool mask in the absorbed form
        if absorbed_is_cheaper(d.kv_lora_rank, d.qk_nope, d.qk_rope, d.v_head, n):
            # absorbed queries (n, N, r + dr) and their latent part; per chunk the latent rows, the scores in
            # the model dtype, scaled, masked and exponentiated in float32.
            attn += b * (2 * n * heads * (d.latent_row) + chunk * d.latent_row) + \
                n * heads * chunk * (b + 12) + masked * chunk
        else:
            # per chunk: latent rows and their expansion (k_nope, v) (keys [k_nope, k_pe] come and go within it);
            # per query the queries [q_nope, q_pe], their padded copy (bf16's flash kernel), the output and its
            # slice; past one chunk the merge state; per block of 128 queries (block_attention's bmm paths) its
            # scores: bf16 scores and float32 probabilities, or in float32 one tensor over at most the keys of one
            # context range (the cached prefix or the new rows: mla_prefill._chunks) with MKL's copies of the block's
            # queries and keys. Coefficients checked against the engine's tracker on the test models
            # (tests/llm/test_kv_sizing.py, float32).
            attn += b * (chunk * (d.latent_row + heads * (d.qk_nope + d.v_head)) + 2 * n * heads * (dq + width)) \
                + (4 * n * heads * (d.v_head + 1) if chunk < context else 0)
            rows, keys = min(n, QUERY_BLOCK), min(chunk, max(context - n, n))
            attn += heads * rows * chunk * (4 + b) if b < 4 else \
                b * heads * (rows * (keys + dq + d.v_head) + keys * dq)
    else:
        attn += b * context * (d.latent_row + heads * (2 * d.qk_nope + d.v_head))
        if attention == "materialised":
            attn += 3 * heads * n * context * 4 + 2 * n * context  # three float32 score tensors, causal masks
    return 2 * n * d.hidden * b + max(attn, _mlp_moe(d, n, attn_tp, b)) + 4 * d.vocab  # one row of logits


def decode_activation_bytes(d: ModelDims, num_seqs: int, context: int, attn_tp: int, expert_ranks: int,
                            act_bytes: int = 2, block_size: int = 16, attention: str = "blockwise") -> float:
    """Peak bytes of live activations on one rank in a decode step of ``num_seqs`` sequences, each attending over
    ``context`` tokens, with the logits of every sequence (float32).

    Args:
        block_size: tokens per KV block (the decode path reads whole blocks).
        attention: "blockwise" (the engine's torch path: groups of
            :func:`~metainfer_gen.llm.attention_chunks.decode_group_tokens` tokens per sequence) or
            "materialised" (the whole context padded to the longest, as before). The GPU kernel holds less.
    Raises:
        ValueError: unknown attention mode.
    """
    if attention not in ("blockwise", "materialised"):
        raise ValueError(f"attention must be 'blockwise' or 'materialised'; got {attention!r}")
    bsz, b = num_seqs, act_bytes
    heads = d.num_heads / attn_tp
    tokens = -(-context // block_size) * block_size
    group = tokens if attention == "materialised" else min(tokens, decode_group_tokens(bsz, block_size, act_bytes=b))
    # absorbed queries (sorted copy included) and the float32 running state; per group the int64 slots, the
    # gathered rows and the scores (two float32 tensors alive at once).
    attn = _projections(d, bsz, heads) * b + 3 * b * bsz * heads * d.latent_row + 12 * bsz * heads * d.kv_lora_rank
    attn += bsz * group * (8 + d.latent_row * b) + \
        bsz * heads * group * max(b + 4, 8)
    if d.index_head_dim:
        attn += bsz * context * (16 + d.index_head_dim * b + 8)  # slots, gathered indexer keys, scores
    return 2 * bsz * d.hidden * b + max(attn, _mlp_moe(d, bsz, attn_tp, b)) + 4 * d.vocab * bsz


def worst_step_activation_bytes(d: ModelDims, chunk: int, max_num_seqs: int, max_model_len: int, attn_tp: int,
                                expert_ranks: int, act_bytes: int = 2, block_size: int = 16) -> dict[str, float]:
    """The two steps KV sizing profiles: the largest prefill chunk at the longest context and the largest decode
    batch (``min(max_num_seqs, chunk)`` sequences) at the longest context.

    Returns:
        {"prefill": bytes, "decode": bytes, "peak": the larger}.
    """
    tokens = min(chunk, max_model_len)
    prefill = prefill_activation_bytes(d, tokens, max_model_len, attn_tp, expert_ranks, act_bytes)
    decode = decode_activation_bytes(d, min(max_num_seqs, chunk), max_model_len, attn_tp, expert_ranks, act_bytes,
                                     block_size)
    return {"prefill": prefill, "decode": decode, "peak": max(prefill, decode)}
