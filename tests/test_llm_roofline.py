"""benchmarks/llm_roofline.py's reading of the profiler: the (batch, M, K, N) of every matmul kind it counts, from the
input shapes torch.profiler records (no model, no timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def roofline():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import llm_roofline
    finally:
        sys.path.remove(str(BENCHMARKS))
    return llm_roofline


def _recorded(fn) -> dict[str, list]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return {e.key: e.input_shapes for e in prof.key_averages(group_by_input_shape=True)}


def test_shapes_of_the_aten_matmuls_as_the_profiler_records_them(roofline):
    x, w, b = torch.randn(5, 7), torch.randn(3, 7), torch.randn(3)
    batched = torch.randn(2, 5, 7), torch.randn(2, 7, 3)
    recorded = _recorded(lambda: (torch.mm(x, w.t()), torch.bmm(*batched), torch.addmm(b, x, w.t())))
    assert roofline.gemm_shape("aten::mm", recorded["aten::mm"]) == (1, 5, 7, 3)
    assert roofline.gemm_shape("aten::bmm", recorded["aten::bmm"]) == (2, 5, 7, 3)
    assert roofline.gemm_shape("aten::addmm", recorded["aten::addmm"]) == (1, 5, 7, 3)


def test_shapes_of_the_frozen_graphs_linears(roofline):
    # as a compiled decode step records them (bf16 oneDNN, float32 MKL), rows flattened from (.., K)
    unary = [[64, 384], [192, 384], [], [], [], []]
    with_bias = [[2, 32, 384], [192, 384], [192], [], [], []]
    binary = [[64, 512], [64, 384], [384, 512], [], []]  # o_proj fused with the residual add
    mkl = [[64, 384], [1], [576, 384], [], []]
    assert roofline.gemm_shape("mkldnn::_linear_pointwise", unary) == (1, 64, 384, 192)
    assert roofline.gemm_shape("mkldnn::_linear_pointwise", with_bias) == (1, 64, 384, 192)
    assert roofline.gemm_shape("mkldnn::_linear_pointwise", binary) == (1, 64, 512, 384)
    assert roofline.gemm_shape("mkl::_mkl_linear", mkl) == (1, 64, 384, 576)
    assert roofline.gemm_shape("aten::mm", [[5, 7]]) is None  # shapes that do not say: not counted


def test_kind_and_alone_timing(roofline):
    assert roofline.kind("aten::bmm", (8, 128, 128, 512)) == "bmm 8x M<=256 K128 N512"
    assert roofline.kind("mkldnn::_linear_pointwise", (1, 64, 384, 4096)) == "linear_pointwise M<=64 K384 N>=700"
    seconds = roofline.time_alone((2, 4, 8, 16), torch.float32, min_s=0.0)
    assert 0.0 < seconds < 1.0
