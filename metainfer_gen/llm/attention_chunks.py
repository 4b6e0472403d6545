"""How much context the blockwise MLA paths read per step: plain arithmetic shared by the layers
(:mod:`metainfer_gen.llm.layers.mla_prefill`, :mod:`metainfer_gen.kernels.paged_mla`) and the planner's memory
formulas (:mod:`metainfer_gen.llm.plan_model`), so the prediction follows the code. No torch.
"""

from __future__ import annotations

__all__ = ["ABSORBED_COST_FACTOR", "DECODE_GROUP_ROWS", "PREFILL_SCORE_BUDGET", "QUERY_BLOCK", "absorbed_is_cheaper",
           "decode_group_tokens", "key_chunk"]

# float32 scores (heads x queries x keys) one prefill chunk may hold: 2^22 = 16 MiB; the fused kernel holds less.
PREFILL_SCORE_BUDGET = 1 << 22
MIN_KEY_CHUNK = 256
# kernels.block_attention.QUERY_BLOCK, repeated so the planner needs no torch (tests/kernels/test_block_attention.py
# checks they agree): queries whose float32 scores the CPU's bf16 prefill path holds at once, per chunk of keys.
QUERY_BLOCK = 128  # fewer keys per chunk cost more in per-call overhead than they save in memory

# kernels.paged_mla.DECODE_GROUP_ROWS, repeated here so the planner needs no torch (tests/llm/test_mla_prefill.py
# checks they agree): context rows the torch decode path gathers per group of blocks, over the whole batch.
DECODE_GROUP_ROWS = 1 << 13


def key_chunk(num_heads: int, num_queries: int, budget: int = PREFILL_SCORE_BUDGET) -> int:
    """Context rows per prefill chunk for ``num_queries`` queries of ``num_heads`` heads: the most whose float32
    scores fit ``budget`` elements, at least :data:`MIN_KEY_CHUNK`; a multiple of 64."""
    return max(MIN_KEY_CHUNK, budget // max(1, num_heads * num_queries) // 64 * 64)


# The absorbed form's multiply-adds (matmul, float32 softmax, matmul) cost about twice the expanded form's, which run
# in PyTorch's fused CPU flash kernel: at DeepSeek-shaped random dims (r 128, heads 8) a 64-token prompt took 0.86 ms
# absorbed against 0.65 ms expanded, though the count favours absorbed below 128 tokens; 16 tokens after 1,024
# cached ones took 1.6 ms absorbed against 5.4 ms expanded (one thread, 2026-12-01).
ABSORBED_COST_FACTOR = 2


def absorbed_is_cheaper(kv_lora_rank: int, nope: int, rope: int, value: int, num_queries: int) -> bool:
    """True when MLA's absorbed form should serve ``num_queries`` queries of one sequence: its multiply-adds per
    head and context row, ``n (2r + dr)``, times :data:`ABSORBED_COST_FACTOR`, below the expanded form's
    ``r (dn + dv) + n (dn + dr + dv)`` (the expansion through ``kv_b_proj`` costs ``r (dn + dv)`` per context row,
    once per chunk of queries, so the absorbed form wins for a few queries over a long cached context)."""
    r = kv_lora_rank
    expanded = r * (nope + value) + num_queries * (nope + rope + value)
    return ABSORBED_COST_FACTOR * num_queries * (2 * r + rope) < expanded


def decode_group_tokens(num_seqs: int, block_size: int, group_rows: int | None = None, act_bytes: int = 4) -> int:
    """Context tokens per sequence the torch decode path reads per group: whole blocks, ``group_rows`` rows over
    the batch (default :data:`DECODE_GROUP_ROWS` float32 rows' worth of bytes in ``act_bytes``-byte values), at
    least one block."""
    group_rows = group_rows or DECODE_GROUP_ROWS * 4 // act_bytes
    return max(1, group_rows // (max(1, num_seqs) * block_size)) * block_size
