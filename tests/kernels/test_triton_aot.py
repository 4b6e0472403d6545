"""Ahead-of-time GPU compiles on this CPU: registers and spills are read, fp32 dots compile to IEEE, and the
AOT table and ``benchmarks/gpu_check.py`` cover every registered op.

The compiles target sm_90, and sm_80/sm_86 for the fp8 kernels' software e4m3 path (Triton compiles for any NVIDIA
arch without a GPU); each takes about a second.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
META = "meta"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def aot(no_interpret):
    pytest.importorskip("triton", reason="ahead-of-time compiles need triton (pip install 'metainfer-gen[kernels]')")
    from metainfer_gen.kernels import aot

    return aot


def _record(arch: int, run) -> list:
    from metainfer_gen.kernels.launch import record_launches

    with record_launches(arch) as launches:
        run()
    return launches


def _impl(op: str):
    from metainfer_gen.kernels.catalog import get_op

    return get_op(op).implementation("triton").fn


def test_record_launches_runs_nothing_and_keeps_the_wrappers_config(no_interpret):
    x = torch.empty(4, 7168, device=META, dtype=torch.bfloat16)
    (launch,) = _record(90, lambda: _impl("rms_norm")(x, None, 1e-6))
    assert launch.grid == (4,) and launch.meta["BLOCK_N"] == 8192 and launch.meta["num_warps"] == 8


def test_compile_reads_registers_spills_and_occupancy(aot):
    x = torch.empty(4, 1536, device=META, dtype=torch.bfloat16)
    (launch,) = _record(90, lambda: _impl("rms_norm")(x, torch.empty(1536, device=META, dtype=torch.bfloat16), 1e-6))
    result = aot.compile_launch(launch, 90)
    assert result.error is None
    assert 0 < result.registers <= 255 and result.spilled == 0
    assert result.warps_per_sm == aot.occupancy(90, result.registers, result.shared, 8) > 0
    assert ".target sm_90" in result.ptx


def test_occupancy_limits():
    from metainfer_gen.kernels.aot import occupancy

    assert occupancy(90, 32, 0, 4) == 64  # warp limit
    assert occupancy(89, 32, 0, 4) == 48
    assert occupancy(90, 255, 0, 4) == 8  # 256 regs x 32 x 4 warps = 32768: two blocks
    assert occupancy(89, 64, 60 * 1024, 4) == 4  # one 60 KB block in 100 KB
    assert occupancy(89, 64, 120 * 1024, 4) == 0  # does not fit at all


def _fp32_dot_launches():
    """Launches of every kernel with a tl.dot whose torch reference computes in float32."""
    f32 = dict(device=META, dtype=torch.float32)
    q, w, keys = torch.empty(1, 4, 64, 128, **f32), torch.empty(1, 4, 64, **f32), torch.empty(1, 256, 128, **f32)
    lengths = torch.empty(1, 4, device=META, dtype=torch.int64)
    yield "indexer_topk", lambda: _impl("indexer_topk")(q, w, keys, lengths, 16, 0.1)
    mq, rows = torch.empty(2, 16, 96, **f32), torch.empty(64, 96, **f32)
    idx = torch.empty(2, 32, device=META, dtype=torch.int64)
    yield "sparse_mla", lambda: _impl("sparse_mla")(mq, rows, idx, 64, 0.1)
    tables, lens = torch.empty(2, 4, device=META, dtype=torch.int64), torch.empty(2, device=META, dtype=torch.int64)
    yield "paged_mla_decode", lambda: _impl("paged_mla_decode")(mq, rows, tables, lens, 16, 64, 0.1)


@pytest.mark.parametrize("op,run", list(_fp32_dot_launches()), ids=lambda v: v if isinstance(v, str) else "")
def test_fp32_reference_dots_compile_to_ieee_not_tf32(aot, op, run):
    for launch in _record(90, run):
        result = aot.compile_launch(launch, 90)
        assert result.error is None, result.error
        tf32_mma = [line.strip() for line in result.ptx.splitlines() if re.search(r"\b(w?gmma|mma)\S*tf32", line)]
        assert not tf32_mma, f"{op}: {launch.name} uses tf32 tensor-core MMAs: {tf32_mma[:2]}"
        assert "inputPrecision = tf32" not in result.ttgir, f"{op}: {launch.name} dots are tf32 in TTGIR"


def _fp8_launches():
    """Launches of every kernel that reads or writes e4m3 (fp8 cache keys and rows included), at small shapes."""
    fp8 = dict(device=META, dtype=torch.float8_e4m3fn)
    f32 = dict(device=META, dtype=torch.float32)
    i64 = dict(device=META, dtype=torch.int64)
    w_q, x_q, scales = torch.empty(256, 256, **fp8), torch.empty(32, 256, **fp8), torch.empty(2, 2, **f32)
    yield lambda: _impl("fp8_act_quant")(torch.empty(32, 256, device=META, dtype=torch.bfloat16))
    yield lambda: _impl("fp8_weight_dequant")(w_q, scales, torch.bfloat16)
    for m in (16, 32):
        yield lambda m=m: _impl("fp8_block_gemm")(x_q[:m], torch.empty(m, 2, **f32), w_q, scales, torch.bfloat16)
    yield lambda: _impl("indexer_topk")(torch.empty(1, 4, 64, 128, **f32), torch.empty(1, 4, 64, **f32),
                                        torch.empty(1, 256, 128, **fp8), torch.empty(1, 4, **i64), 16, 0.1)
    yield lambda: _impl("sparse_mla")(torch.empty(2, 16, 96, **f32), torch.empty(64, 96, **fp8),
                                      torch.empty(2, 32, **i64), 64, 0.1)
    yield lambda: _impl("paged_mla_decode")(torch.empty(2, 16, 96, **f32), torch.empty(64, 96, **fp8),
                                            torch.empty(2, 4, **i64), torch.empty(2, **i64), 16, 64, 0.1)


@pytest.mark.parametrize("arch", [80, 86])
def test_fp8_kernels_compile_below_sm89_in_software(aot, arch):
    """Triton has no e4m3 below sm_89 ("type fp8e4nv not supported"): the wrappers pick the uint8 software path there,
    so every fp8 kernel compiles, without spills, and its PTX converts no e4m3 in hardware."""
    launches = [launch for run in _fp8_launches() for launch in _record(arch, run)]
    assert len(launches) == 7 and all(launch.meta["SOFT_FP8"] for launch in launches)
    for launch in launches:
        result = aot.compile_launch(launch, arch)
        assert result.error is None, f"{launch.name}: {result.error}"
        assert result.spilled == 0 and "e4m3" not in result.ptx, launch.name


def test_aot_table_covers_every_triton_op(no_interpret):
    triton_aot = _load("triton_aot")
    assert set(triton_aot.triton_ops()) <= {case.op for case in triton_aot.cases()}


def test_gpu_check_covers_exactly_the_registered_ops():
    from metainfer_gen.kernels.catalog import registered_ops

    gpu_check = _load("gpu_check")
    assert sorted(gpu_check.OPS) == sorted(op.name for op in registered_ops())
