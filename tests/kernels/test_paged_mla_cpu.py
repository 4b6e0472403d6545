"""The C++ CPU paged MLA decode against the whole-context torch reference: block sizes 1/16/64, head counts that
fill and do not fill its 8-head groups, contexts split into pieces merged by log-sum-exp, bad inputs, refusals, the
on/off switch and a build that fails. Tolerances: float32 atol = rtol = 1e-5, bfloat16 the suite's bound."""

from __future__ import annotations


import pytest
import torch

from metainfer_gen.kernels import cpu_build, paged_mla, paged_mla_cpu
from tests.kernels.conftest import assert_close, require_cpu_kernel
from tests.kernels.test_paged_mla import _inputs


@pytest.fixture(scope="module", autouse=True)
def built():
    require_cpu_kernel(paged_mla_cpu.warm_up)


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
@pytest.mark.parametrize("heads", [20, 8, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(block_size, heads, dtype):
    """Block size 1 and odd context lengths give the bf16 value pass an unpaired last token; 256 runs it in two
    chunks of 128 tokens."""
    q, rows, tables, lens, rank = _inputs(block_size, heads=heads, dtype=dtype)
    ref = paged_mla.paged_mla_decode_reference(q.float(), rows.float(), tables, lens, block_size, rank, 0.3)
    assert_close(paged_mla_cpu.paged_mla_decode_cpp(q, rows, tables, lens, block_size, rank, 0.3), ref.to(dtype))


@pytest.mark.parametrize("dims", [(512, 64), (128, 64)], ids=["576-512", "192-128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_and_small_latent_widths(dims, dtype):
    """The shared cases' MLA widths: DeepSeek's 576 / 512 and a 192 / 128 latent, at page size 16."""
    rank, rope = dims
    q, rows, tables, lens, rank = _inputs(16, heads=16, rank=rank, rope=rope, dtype=dtype)
    ref = paged_mla.paged_mla_decode_reference(q.float(), rows.float(), tables, lens, 16, rank, 0.1)
    assert_close(paged_mla_cpu.paged_mla_decode_cpp(q, rows, tables, lens, 16, rank, 0.1), ref.to(dtype))


@pytest.mark.parametrize("threads", [1, 2])
def test_long_context_split_into_pieces_merges_exactly(threads):
    """One sequence of 4,000 tokens with a short one beside it: the long context is cut into pieces (at least 8
    blocks each, enough for every thread) and merged by log-sum-exp; DeepSeek's 512 + 64 latent."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, rows, tables, lens, rank = _inputs(16, lens=(4000, 3), heads=8, rank=512, rope=64)
        ref = paged_mla.paged_mla_decode_reference(q, rows, tables, lens, 16, rank, 0.05)
        assert_close(paged_mla_cpu.paged_mla_decode_cpp(q, rows, tables, lens, 16, rank, 0.05), ref)
    finally:
        torch.set_num_threads(before)


def test_reads_only_each_sequences_own_context():
    """Every row outside a sequence's context (the -1 table entries past it included) poisoned: same answer."""
    q, rows, tables, lens, rank = _inputs(16, heads=8)
    out = paged_mla_cpu.paged_mla_decode_cpp(q, rows, tables, lens, 16, rank, 0.3)
    poisoned = torch.full_like(rows, float("nan"))
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[i, pos // 16] * 16 + pos % 16
        poisoned[slots] = rows[slots]
    torch.testing.assert_close(paged_mla_cpu.paged_mla_decode_cpp(q, poisoned, tables, lens, 16, rank, 0.3), out,
                               atol=0, rtol=0)


def test_a_strided_cache_view_is_read_in_place():
    """The cache's flat rows may be a column slice of wider rows (unit column stride, longer row stride)."""
    q, rows, tables, lens, rank = _inputs(16, heads=8)
    wide = torch.cat([rows, torch.randn(rows.shape[0], 24)], dim=1)[:, : rows.shape[1]]
    assert not wide.is_contiguous()
    assert_close(paged_mla_cpu.paged_mla_decode_cpp(q, wide, tables, lens, 16, rank, 0.3),
                 paged_mla.paged_mla_decode_reference(q, rows, tables, lens, 16, rank, 0.3))


def test_bad_lengths_and_block_ids_are_errors_not_reads():
    q, rows, tables, lens, rank = _inputs(16, lens=(5, 40), heads=4)
    for bad in (torch.tensor([0, 40]), torch.tensor([5, tables.shape[1] * 16 + 1])):
        with pytest.raises(RuntimeError, match=r"context_lens\[\d\] = \d+ is outside"):
            paged_mla_cpu.paged_mla_decode_cpp(q, rows, tables, bad, 16, rank, 0.3)
    far = tables.clone()
    far[1, 0] = rows.shape[0] // 16  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_mla_cpu.paged_mla_decode_cpp(q, rows, far, lens, 16, rank, 0.3)
    assert paged_mla_cpu.paged_mla_decode_cpp(q[:0], rows, tables[:0], lens[:0], 16, rank, 0.3).shape == (0, 4, rank)


def test_refusals_name_what_does_not_fit():
    q, rows, tables, lens, rank = _inputs(16, heads=4)
    supports = paged_mla_cpu.paged_mla_decode_cpp_supports
    assert supports(q, rows, tables, lens, 16, rank, 0.3) is None
    assert "cache dtype" in supports(q, rows.to(torch.float8_e4m3fn), tables, lens, 16, rank, 0.3)
    assert "float16" in supports(q.half(), rows.half(), tables, lens, 16, rank, 0.3)
    assert "multiples of 16" in supports(q, rows, tables, lens, 16, 24, 0.3)
    assert "strided" in supports(q, rows.t().contiguous().t(), tables, lens, 16, rank, 0.3)


def test_switch_off_falls_back_to_the_blocks_with_the_reason(monkeypatch):
    q, rows, tables, lens, rank = _inputs(16, heads=4)
    monkeypatch.setenv(cpu_build.DISABLE_ENV, "0")
    impl, refusals = paged_mla.PAGED_MLA_DECODE.select(q, rows, tables, lens, 16, rank, 0.3)
    assert impl.name == "torch-blocks" and "METAINFER_CPU_KERNELS=0" in refusals[-1].reason
    monkeypatch.delenv(cpu_build.DISABLE_ENV)
    assert paged_mla.PAGED_MLA_DECODE.select(q, rows, tables, lens, 16, rank, 0.3)[0].name == "cpp"


def test_a_build_that_fails_is_a_refusal_with_the_compilers_words(tmp_path, monkeypatch):
    (tmp_path / "broken.cpp").write_text("#include <torch/extension.h>\nint f() { return undefined_name; }\n")
    monkeypatch.setattr(cpu_build, "SOURCES", tmp_path)
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "cache"))
    module, reason = cpu_build.load_built("broken")
    assert module is None and "did not build" in reason
    with pytest.raises(RuntimeError, match="did not build"):
        cpu_build.ensure_built("broken")


def test_a_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path, monkeypatch):
    (tmp_path / "tiny.cpp").write_text("#include <torch/extension.h>\nint answer() { return 42; }\n"
                                       "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"answer\", &answer); }\n")
    monkeypatch.setattr(cpu_build, "SOURCES", tmp_path)
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "cache"))
    where = tmp_path / "cache" / f"tiny-{cpu_build.build_key('tiny')}"
    where.mkdir(parents=True)
    (where / "lock").touch()  # torch's build baton, as a build killed mid-way leaves it
    module, reason = cpu_build.load_built("tiny")  # waited for the baton forever before
    assert reason is None and module.answer() == 42 and not (where / "lock").exists()


def test_two_checkouts_build_in_two_folders(tmp_path, monkeypatch):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "k.cpp").write_text("// same text\n")
    monkeypatch.setattr(cpu_build, "SOURCES", tmp_path / "a")
    first = cpu_build.build_key("k")
    monkeypatch.setattr(cpu_build, "SOURCES", tmp_path / "b")
    assert cpu_build.build_key("k") != first


def test_build_key_follows_the_source_and_the_cpu(tmp_path, monkeypatch):
    (tmp_path / "k.cpp").write_text("// one\n")
    monkeypatch.setattr(cpu_build, "SOURCES", tmp_path)
    first = cpu_build.build_key("k")
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset({"avx2"}))
    other_cpu = cpu_build.build_key("k")
    (tmp_path / "k.cpp").write_text("// two\n")
    assert len({first, other_cpu, cpu_build.build_key("k")}) == 3


def test_vectors_are_one_register_of_the_build_target():
    """16 floats (a zmm register) where the CPU has AVX-512, else 8 (a ymm register): a 16-float vector on an AVX2
    target lives on the stack and the kernel ran slower than the torch path it replaces."""
    from metainfer_gen.platform import cpu_flags

    module = cpu_build.ensure_built(paged_mla_cpu.KERNEL)
    assert module.lanes == (16 if "avx512f" in cpu_flags() else 8)
