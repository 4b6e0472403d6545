"""Paged MLA decode: the blockwise torch path and the Triton kernel (interpreter) against the whole-context
reference, at page sizes 1, 16 and 64, with contexts of very different lengths. Tolerances: float32 atol = rtol =
1e-5, bfloat16 the suite's one-ulp bound (conftest.TOL)."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import paged_mla, paged_mla_triton
from tests.kernels.conftest import assert_close, requires_cuda


def _inputs(block_size: int, lens=(1, 17, 300, 64, 250), heads=20, rank=32, rope=16, dtype=torch.float32):
    width = -(-max(lens) // block_size) + 1  # one spare column of -1 past every table
    num_blocks = len(lens) * width + 3
    rows = torch.randn(num_blocks * block_size, rank + rope + 8).to(dtype)  # 8 trailing indexer columns
    tables = torch.full((len(lens), width), -1, dtype=torch.long)
    perm = torch.randperm(num_blocks)
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        tables[i, :used] = perm[i * width: i * width + used]
    q = torch.randn(len(lens), heads, rank + rope).to(dtype if dtype != torch.float8_e4m3fn else torch.float32)
    return q, rows, tables, torch.tensor(lens), rank


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("group_rows", [16, 256, 1 << 13])
def test_blocks_match_reference(block_size, group_rows):
    q, rows, tables, lens, rank = _inputs(block_size)
    ref = paged_mla.paged_mla_decode_reference(q, rows, tables, lens, block_size, rank, 0.3)
    out = paged_mla.paged_mla_decode_blocks(q, rows, tables, lens, block_size, rank, 0.3, group_rows=group_rows)
    assert_close(out, ref)


def test_blocks_bf16_and_fp8_cache():
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        q, rows, tables, lens, rank = _inputs(16, dtype=dtype)
        ref = paged_mla.paged_mla_decode_reference(q, rows, tables, lens, 16, rank, 0.3)
        out = paged_mla.paged_mla_decode_blocks(q, rows, tables, lens, 16, rank, 0.3, group_rows=64)
        assert_close(out, ref)


def test_each_sequence_reads_only_its_own_context():
    """Poisoning every cache row outside a sequence's context changes nothing."""
    q, rows, tables, lens, rank = _inputs(16)
    out = paged_mla.paged_mla_decode_blocks(q, rows, tables, lens, 16, rank, 0.3, group_rows=64)
    poisoned = torch.full_like(rows, 1e4)
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[i, pos // 16] * 16 + pos % 16
        poisoned[slots] = rows[slots]
    torch.testing.assert_close(paged_mla.paged_mla_decode_blocks(q, poisoned, tables, lens, 16, rank, 0.3,
                                                                 group_rows=64), out)


def test_dispatch_takes_the_cpp_kernel_on_the_cpu_and_the_blocks_where_it_refuses():
    q, rows, tables, lens, rank = _inputs(16)
    op = paged_mla.PAGED_MLA_DECODE
    impl, refusals = op.select(q, rows, tables, lens, 16, rank, 0.3)
    assert impl.name == "cpp" and refusals[0].implementation == "triton"
    impl, refusals = op.select(q, rows.to(torch.bfloat16), tables, lens, 16, rank, 0.3)  # cache dtype differs
    assert impl.name == "torch-blocks" and "cache dtype" in refusals[-1].reason
    with pytest.raises(ValueError, match="paged_mla_decode needs"):
        paged_mla.paged_mla_decode(q, rows, tables[:2], lens, 16, rank, 0.3)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_triton_matches_reference(interpret, block_size):
    q, rows, tables, lens, rank = _inputs(block_size, lens=(1, 40, 130), heads=20)
    ref = paged_mla.paged_mla_decode_reference(q, rows, tables, lens, block_size, rank, 0.3)
    assert_close(paged_mla_triton.paged_mla_decode_triton(q, rows, tables, lens, block_size, rank, 0.3), ref)


def test_triton_reads_a_slice_of_a_wider_table_in_place(interpret):
    """Static decode passes ``block_tables[:size, :width]`` of its buffer: a row stride wider than the slice. The
    kernel reads it in place (no contiguous copy, no fallback) and answers as on the contiguous table."""
    q, rows, tables, lens, rank = _inputs(16, lens=(5, 40, 70), heads=4)
    buffer = torch.full((8, tables.shape[1] + 9), -1, dtype=torch.long)
    buffer[:3, :tables.shape[1]] = tables
    sliced = buffer[:3, :tables.shape[1]]
    assert not sliced.is_contiguous()
    refusal = paged_mla_triton.paged_mla_decode_supports(q, rows, sliced, lens, 16, rank, 0.3)
    assert refusal is None or "block" not in refusal  # here only "CPU-only machine"
    ref = paged_mla.paged_mla_decode_reference(q, rows, tables, lens, 16, rank, 0.3)
    assert_close(paged_mla_triton.paged_mla_decode_triton(q, rows, sliced, lens, 16, rank, 0.3), ref)


@pytest.mark.parametrize("software", [False, True], ids=["fp8", "soft-e4m3"])  # True: the sm_80 path (fp8_codec)
def test_triton_fp8_cache(interpret, software):
    q, rows, tables, lens, rank = _inputs(16, lens=(5, 70), heads=4, dtype=torch.float8_e4m3fn)
    ref = paged_mla.paged_mla_decode_reference(q, rows, tables, lens, 16, rank, 0.3)
    assert_close(paged_mla_triton.paged_mla_decode_triton(q, rows, tables, lens, 16, rank, 0.3, software), ref)


def test_splits_fill_the_gpu_and_never_exceed_the_context():
    assert paged_mla_triton.decode_splits(1, 8, 32768, 16) == 33  # 264 programs over 8 head groups
    assert paged_mla_triton.decode_splits(64, 8, 32768, 16) == 1
    assert paged_mla_triton.decode_splits(1, 1, 64, 16) == 1  # at least four tiles per split


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_on_cuda_at_deepseek_width(dtype):
    """The compiled kernel (not the interpreter) at V3's 512 + 64 latent, 128 heads, page 64, with splits."""
    q, rows, tables, lens, rank = _inputs(64, lens=(1, 700, 4096, 3000), heads=128, rank=512, rope=64, dtype=dtype)
    q, rows, tables, lens = q.cuda(), rows.cuda(), tables.cuda(), lens.cuda()
    ref = paged_mla.paged_mla_decode_reference(q, rows, tables, lens, 64, rank, 0.05)
    out = paged_mla.paged_mla_decode(q, rows, tables, lens, 64, rank, 0.05, strict=True)
    assert_close(out, ref)
