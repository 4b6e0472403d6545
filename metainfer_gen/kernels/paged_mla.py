"""Paged MLA decode: one absorbed query per sequence over its latent-cache blocks, read through the block table.

MLA's absorbed form (DeepSeek-V2 paper, eq. 9-11; vLLM ``MLACommonImpl._forward_decode``, FlashMLA): a query is
``[q_nope @ W_UK, q_pe]`` (N heads, r + dr wide) and scores directly against the cache rows ``[c_kv, k_pe]``; the
value is ``c_kv`` itself (the caller applies W_UV). Sequences of a batch have different contexts, so:

- ``cpp`` (the CPU path): the same walk in C++, every block read in place through the table; see
  :mod:`metainfer_gen.kernels.paged_mla_cpu`.
- ``torch-blocks`` (the CPU fallback where the C++ kernel is off or does not apply) walks the context a group of blocks
  at a time with an online softmax (FlashAttention's running max and sum, Dao et al. 2022; flash-decoding's split of the
  keys): per group it gathers only the rows of the sequences still inside their context (sorted by length, so no
  sequence is padded to the longest by more than one group), so memory per step is ``batch x group`` rows, not
  ``batch x context``. A batch whose longest context fits one group runs one masked softmax.
- ``triton`` (GPU): one program per (sequence, 16 heads, split of the context), each walking its split's blocks in
  place and writing a partial output with its log-sum-exp, merged by log-sum-exp (flash-decoding). See
  :mod:`metainfer_gen.kernels.paged_mla_triton`.
- ``torch`` (reference): gather every sequence's whole context padded to the longest, one masked softmax.
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.paged_mla_cpu import paged_mla_decode_cpp, paged_mla_decode_cpp_supports
from metainfer_gen.kernels.paged_mla_triton import paged_mla_decode_supports, paged_mla_decode_triton
from metainfer_gen.kernels.registry import Op, register_op
from metainfer_gen.kernels.sparse_attention import gather_rows

__all__ = ["DECODE_GROUP_ROWS", "paged_mla_decode", "paged_mla_decode_blocks", "paged_mla_decode_reference"]

# Context rows the torch path gathers per group of blocks, over the whole batch, in float32 (2^13 rows of 576
# values = 18 MiB); a 2-byte run dtype gathers twice the rows in the same bytes (64 sequences of up to 256 tokens
# then take one group: 2.3 ms against 3.4 ms in two, bf16 on 2 AMX cores). Smaller groups pad less (a sequence
# wastes at most one group) but cost more ops per layer. The planner's memory formula reads the same number
# (metainfer_gen.llm.attention_chunks; a test checks they agree).
DECODE_GROUP_ROWS = 1 << 13


def _slots(block_tables: torch.Tensor, block_size: int, first: int, last: int) -> torch.Tensor:
    """(B, (last - first) * block_size) flat slots of table columns [first, last); -1 entries read block 0."""
    offsets = torch.arange(block_size, device=block_tables.device)
    blocks = block_tables[:, first:last].clamp_min(0) * block_size
    return (blocks[:, :, None] + offsets).flatten(1)


def _gather_blocks(kv_rows: torch.Tensor, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """The rows of table's blocks (B, w) in order -> (B, w * block_size, row); -1 entries read block 0. One copy
    per whole block where the rows are the contiguous flat view of a paged cache (1.35x the row-by-row gather at
    64 sequences x 20 blocks of 576-wide bf16 rows, one AVX512-BF16 thread), else per row."""
    batch, width = table.shape[0], kv_rows.shape[-1]
    if not kv_rows.is_contiguous() or kv_rows.shape[0] % block_size:
        return gather_rows(kv_rows, _slots(table, block_size, 0, table.shape[1]))
    blocks = gather_rows(kv_rows.view(-1, block_size * width), table.clamp_min(0))
    return blocks.view(batch, table.shape[1] * block_size, width)


def _masked_softmax_value(q, context, lengths, first_pos: int, scale: float, value_dim: int) -> torch.Tensor:
    """softmax over context rows (B, L, >= Dk) at positions first_pos.. masked past ``lengths`` (B,) -> (B, N, r)."""
    context = _key_rows(context, q)
    scores = _scores(q, context).float() * scale  # (B, N, L)
    pos = torch.arange(first_pos, first_pos + context.shape[1], device=q.device)
    scores = scores.masked_fill((pos[None, :] >= lengths[:, None])[:, None, :], float("-inf"))
    return _weighted(scores.softmax(-1).to(context.dtype), context, value_dim)


def _key_rows(context: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Gathered rows (B, L, >= Dk) in q's dtype, cut to Dk columns only where they must be cast anyway (a
    column slice makes the rows strided, which sends CPU ``bmm`` down a copy)."""
    if context.dtype == q.dtype:
        return context
    return context[..., : q.shape[-1]].to(q.dtype)


def _scores(q: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """q (B, N, Dk) against rows (B, L, >= Dk) -> (B, N, L). ``bmm`` on the transposed rows, never ``matmul``: on a
    CPU in bf16 ``matmul`` copied the (B, Dk, L) operand and ran 11x slower (1.65 vs 0.15 ms at B=32, L=128)."""
    dk = q.shape[-1]
    if context.shape[-1] != dk:  # extra columns (the indexer key) join as zero query columns
        q = torch.nn.functional.pad(q, (0, context.shape[-1] - dk))
    return torch.bmm(q, context.transpose(1, 2))


def _weighted(probs: torch.Tensor, context: torch.Tensor, value_dim: int) -> torch.Tensor:
    """probs (B, N, L) over rows (B, L, >= r) -> (B, N, r): the product with the whole contiguous rows, then the
    first r columns (a strided r-column operand ran 7x slower through CPU ``bmm`` than the 12% extra columns)."""
    return torch.bmm(probs, context)[..., :value_dim]


def paged_mla_decode_reference(q: torch.Tensor, kv_rows: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, block_size: int, value_dim: int,
                               scale: float) -> torch.Tensor:
    """The whole padded context at once (the engine's path before blocks): same arguments as
    :func:`paged_mla_decode`, memory (B, W * block_size, row) + (B, N, W * block_size) float32."""
    slots = _slots(block_tables, block_size, 0, block_tables.shape[1])
    return _masked_softmax_value(q, gather_rows(kv_rows, slots), context_lens, 0, scale, value_dim).to(q.dtype)


def paged_mla_decode_blocks(q: torch.Tensor, kv_rows: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, block_size: int, value_dim: int, scale: float,
                            group_rows: int | None = None) -> torch.Tensor:
    """Groups of blocks with an online softmax; same arguments as :func:`paged_mla_decode`; ``group_rows`` bounds
    the rows gathered per group over the batch. On the CPU the rows are sorted by context length (read on the
    host) so each group gathers only the sequences still inside their context; elsewhere every group reads every
    row (no host read, so a CUDA graph can capture it) and masks."""
    batch = q.shape[0]
    if batch == 0:
        return q.new_empty(0, q.shape[1], value_dim)
    if group_rows is None:
        group_rows = DECODE_GROUP_ROWS * 4 // q.element_size()  # the same bytes whatever the run dtype
    group = max(1, group_rows // (batch * block_size))  # blocks per group
    if q.device.type == "cpu":
        lengths = context_lens.tolist()
        order = sorted(range(batch), key=lambda i: -lengths[i])
        sorted_lens = [lengths[i] for i in order]
        num_blocks = -(-sorted_lens[0] // block_size)
        ends = [-(-n // block_size) for n in sorted_lens]  # blocks each sorted row reads
    else:
        order, num_blocks, ends, sorted_lens = None, block_tables.shape[1], None, None
    if num_blocks <= group:  # one group: the masked softmax over the longest context
        context = _gather_blocks(kv_rows, block_tables[:, :num_blocks], block_size)
        return _masked_softmax_value(q, context, context_lens, 0, scale, value_dim).to(q.dtype)
    index = None if order is None else torch.tensor(order, device=q.device)
    if index is not None:  # the block table is read a group of columns at a time, in this order
        q, context_lens = q[index], context_lens[index]
    m = torch.full((batch, q.shape[1]), float("-inf"), device=q.device)  # running max (B, N)
    denom = torch.zeros_like(m)
    acc = torch.zeros(batch, q.shape[1], value_dim, device=q.device)  # unnormalised output (B, N, r) float32
    for first in range(0, num_blocks, group):
        last = min(first + group, num_blocks)
        rows = batch if ends is None else sum(e > first for e in ends)  # sorted: the active rows are a prefix
        table = block_tables[:, first:last] if index is None else block_tables[index[:rows], first:last]
        context = _key_rows(_gather_blocks(kv_rows, table, block_size), q)
        scores = _scores(q[:rows], context).float() * scale  # (b, N, g)
        if sorted_lens is None or sorted_lens[rows - 1] < last * block_size:  # a row ends inside the group
            pos = torch.arange(first * block_size, last * block_size, device=q.device)
            scores = scores.masked_fill((pos[None, :] >= context_lens[:rows, None])[:, None, :], float("-inf"))
        m_new = torch.maximum(m[:rows], scores.amax(-1))
        alpha = torch.exp(m[:rows] - m_new)
        probs = torch.exp(scores - m_new[..., None])
        denom[:rows] = denom[:rows] * alpha + probs.sum(-1)
        acc[:rows] = acc[:rows] * alpha[..., None] + _weighted(probs.to(context.dtype), context, value_dim).float()
        m[:rows] = m_new
        del context, scores, probs  # before the next group's gather: one group's rows alive at a time
    out = (acc / denom[..., None]).to(q.dtype)
    if index is None:
        return out
    return torch.empty_like(out).index_copy_(0, index, out)


def _example(device: str, dtype: torch.dtype):
    batch, heads, block, blocks = 8, 16, 64, 64  # 8 decodes, 16 heads per rank, up to 4K tokens each
    q = torch.randn(batch, heads, 576, device=device, dtype=dtype)
    rows = torch.randn(batch * blocks * block, 576, device=device, dtype=dtype)
    tables = torch.randperm(batch * blocks, device=device).view(batch, blocks)
    lens = torch.randint(1, blocks * block + 1, (batch,), device=device)
    return (q, rows, tables, lens, block, 512, 192 ** -0.5), {}


PAGED_MLA_DECODE = register_op(Op("paged_mla_decode", "absorbed MLA decode over the paged latent cache",
                                  _example))
PAGED_MLA_DECODE.register("triton", paged_mla_decode_triton, paged_mla_decode_supports,
                          description="flash-decoding: (sequence, 16 heads, context split) programs, LSE merge")
PAGED_MLA_DECODE.register("cpp", paged_mla_decode_cpp, paged_mla_decode_cpp_supports, devices=("cpu",),
                          description="C++ on the CPU: blocks read in place, online softmax, pieces merged by LSE")
PAGED_MLA_DECODE.register("torch-blocks", paged_mla_decode_blocks,
                          description="groups of blocks, online softmax, no padding past one group")
PAGED_MLA_DECODE.register("torch", paged_mla_decode_reference,
                          description="whole context padded to the longest, one masked softmax")


def paged_mla_decode(q: torch.Tensor, kv_rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     block_size: int, value_dim: int, scale: float, *, site: str | None = None,
                     strict: bool | None = None) -> torch.Tensor:
    """Absorbed MLA attention of one query per sequence over its paged latent cache.

    Args:
        q: (B, N, r + dr) absorbed queries ``[q_nope @ W_UK, q_pe]``, float32/bfloat16/float16.
        kv_rows: (num_blocks * block_size, row >= r + dr) cache rows ``[c_kv, k_pe, ...]`` (the flat view of the
            paged cache; extra columns such as the indexer key are ignored), any float dtype or float8_e4m3fn.
        block_tables: (B, W) int64 cache blocks of each sequence in order; entries past a sequence's blocks may
            be anything (-1 included), they are never read unmasked.
        context_lens: (B,) int64 tokens each sequence attends to, 1 <= len <= W * block_size.
        block_size: tokens per cache block.
        value_dim: r (the value is ``c_kv``).
        scale: softmax scale.
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Returns:
        (B, N, r) in q.dtype.
    Raises:
        ValueError: inconsistent shapes.
    Tolerance against :func:`paged_mla_decode_reference`: atol=rtol=1e-5 (float32).
    """
    if q.ndim != 3 or kv_rows.ndim != 2 or kv_rows.shape[1] < q.shape[2] or block_tables.ndim != 2 \
            or block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],) \
            or not 0 < value_dim < q.shape[2] or block_size < 1:
        raise ValueError(f"paged_mla_decode needs q (B, N, Dk), kv_rows (S, >= Dk), block_tables (B, W), "
                         f"context_lens (B,), 0 < value_dim < Dk, block_size >= 1; got {tuple(q.shape)}, "
                         f"{tuple(kv_rows.shape)}, {tuple(block_tables.shape)}, {tuple(context_lens.shape)}, "
                         f"{value_dim}, {block_size}")
    return PAGED_MLA_DECODE.dispatch(q, kv_rows, block_tables.long(), context_lens.long(), block_size, value_dim, scale,
                                     site=site, strict=strict, stacklevel=2)
