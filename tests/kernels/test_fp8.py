"""FP8 block scaling: activation quant, weight dequant and the block GEMM against independent oracles, and the
Triton kernels against their references under the interpreter.

Stated tolerances: the GEMM paths against an fp32 oracle of the same quantised operands, relative Frobenius error
below 2e-2 (measured about 2e-7: only the summation order differs); against the unquantised fp32 product, below
5e-2 (e4m3 keeps 3 mantissa bits: measured about 3.7% for Gaussian inputs).
"""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import fp8_gemm, fp8_quant

KS = (64, 128, 192, 200, 320)
NS = (64, 192, 576)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _blockwise_oracle(x_q, x_s, w_q, w_s):
    """DeepGEMM's formulation written as a loop: per K block, the fp32 partial product times both scales."""
    m, k = x_q.shape
    out = torch.zeros(m, w_q.shape[0])
    for b in range(-(-k // 128)):
        cols = slice(b * 128, min(k, (b + 1) * 128))
        w_scale = w_s[:, b].repeat_interleave(128)[: w_q.shape[0]]
        out += (x_q[:, cols].float() @ w_q[:, cols].float().T) * x_s[:, b:b + 1] * w_scale[None, :]
    return out


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("k", KS)
def test_block_gemm_error_table(k, n):
    x, w = torch.randn(33, k), torch.randn(n, k)
    x_q, x_s = fp8_quant.fp8_act_quant_reference(x)
    w_q, w_s = fp8_quant.quantize_fp8_weight(w)
    assert w_s.shape == (-(-n // 128), -(-k // 128))  # the partial last block has its own scale
    y = fp8_gemm.fp8_block_gemm_reference(x_q, x_s, w_q, w_s, torch.float32)
    assert _rel(y, _blockwise_oracle(x_q, x_s, w_q, w_s)) < 2e-2
    assert _rel(y, x @ w.T) < 5e-2
    if k % 128:  # dropping the partial block's scale (the classic bug) must show
        dropped = w_s.clone()
        dropped[:, -1] = 0
        assert _rel(fp8_gemm.fp8_block_gemm_reference(x_q, x_s, w_q, dropped, torch.float32), y) > 0.1


def test_cpu_gemm_dequantises_one_group_of_tile_rows_at_a_time(monkeypatch):
    """With a 1-byte budget each group is one 128-row tile row (the last one partial): never the whole weight."""
    x_q, x_s = fp8_quant.fp8_act_quant_reference(torch.randn(7, 200))
    w_q, w_s = fp8_quant.quantize_fp8_weight(torch.randn(450, 200))
    whole = fp8_gemm.fp8_block_gemm_reference(x_q, x_s, w_q, w_s, torch.float32)  # 16 MiB budget: one group
    seen = []

    def recording(w, s, dtype=torch.float32):
        seen.append((tuple(w.shape), tuple(s.shape)))
        return fp8_quant.dequantize_fp8_weight_reference(w, s, dtype)

    monkeypatch.setattr(fp8_gemm, "DEQUANT_BYTES", 1)
    monkeypatch.setattr(fp8_gemm, "dequantize_fp8_weight_reference", recording)
    grouped = fp8_gemm.fp8_block_gemm_reference(x_q, x_s, w_q, w_s, torch.bfloat16)
    assert seen == [((128, 200), (1, 2))] * 3 + [((66, 200), (1, 2))]
    assert _rel(grouped, whole) < 1e-2 and _rel(grouped.float(), _blockwise_oracle(x_q, x_s, w_q, w_s)) < 1e-2
    torch.testing.assert_close(fp8_gemm.fp8_block_gemm_reference(x_q, x_s, w_q, w_s, torch.float32), whole,
                               rtol=1e-6, atol=1e-5)


# software=True: the sm_80 path (e4m3 decoded/encoded in the kernel from uint8 codes, fp16 dots; fp8_codec).
SOFTWARE = pytest.mark.parametrize("software", [False, True], ids=["fp8", "soft-e4m3"])


@SOFTWARE
@pytest.mark.parametrize("m,k,n", [(20, 64, 64), (16, 200, 192), (33, 320, 576)])
def test_triton_gemm_matches_reference(interpret, m, k, n, software):
    x_q, x_s = fp8_quant.fp8_act_quant_reference(torch.randn(m, k))
    w_q, w_s = fp8_quant.quantize_fp8_weight(torch.randn(n, k))
    ref = fp8_gemm.fp8_block_gemm_reference(x_q, x_s, w_q, w_s, torch.float32)
    assert _rel(fp8_gemm.fp8_block_gemm_triton(x_q, x_s, w_q, w_s, torch.float32, software), ref) < 1e-5


@SOFTWARE
@pytest.mark.parametrize("shape", [(5, 64), (3, 200), (2, 384)])
def test_triton_act_quant_and_dequant_match_reference(interpret, shape, software):
    x = torch.randn(*shape) * torch.exp2(torch.randint(-12, 12, shape).float())  # into the e4m3 subnormals
    q_ref, s_ref = fp8_quant.fp8_act_quant_reference(x)
    q, s = fp8_quant.fp8_act_quant_triton(x, software)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    w_q, w_s = fp8_quant.quantize_fp8_weight(torch.randn(shape[1] + 70, shape[1]))
    for dtype in (torch.float32, torch.float16):  # not bf16: the interpreter's fp32 -> bf16 cast truncates
        assert torch.equal(fp8_quant.fp8_weight_dequant_triton(w_q, w_s, dtype, software),
                           fp8_quant.dequantize_fp8_weight_reference(w_q, w_s, dtype))


def test_quantisation_round_trip_and_scale_grid_checks():
    w = torch.randn(200, 130)
    q, s = fp8_quant.quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2)
    back = fp8_quant.fp8_weight_dequant(q, s)
    assert _rel(back, w) < 4e-2
    # Re-quantising a dequantised tile gives its bytes back: each tile's largest value is 448 x its scale.
    q2, s2 = fp8_quant.quantize_fp8_weight(back)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    with pytest.raises(ValueError, match="partial last tiles"):
        fp8_quant.fp8_weight_dequant(q, s[:, :1])  # K // 128 columns: the partial block dropped
    x_q, x_s = fp8_quant.fp8_act_quant(torch.randn(4, 130))
    assert x_s.shape == (4, 2)
    y = fp8_gemm.fp8_linear(torch.randn(2, 3, 130), q, s)
    assert y.shape == (2, 3, 200)
