"""The sm_80 software e4m3 path: decode and encode against torch's float8_e4m3fn casts, bit for bit, under the
interpreter; weight dequant of every code; and which path the wrappers pick for a given compute capability. The
fp8 kernels' own tests run with the software path forced on as well (``test_fp8.py``, ids ``soft-e4m3``).

Stated tolerance: none; decode and encode are exact (every one of the 256 codes, NaN where torch has NaN).
"""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.kernels import fp8_codec, fp8_gemm, fp8_quant

FP8 = torch.float8_e4m3fn
ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)

# Bound when the test kernels are built (inside a test, under the interpreter); kernels look names up in globals.
tl = triton = e4m3_to_fp16 = fp32_to_e4m3 = None


@fp8_codec.lazy_fp8_kernel
def _codec_kernels():
    """Elementwise kernels around the two helpers, to feed them values the fp8 kernels never produce (|x| > 448)."""
    global tl, triton
    import triton
    import triton.language as tl

    @triton.jit
    def encode_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, fp32_to_e4m3(tl.load(x_ptr + i, mask=i < n, other=0.0)), mask=i < n)

    @triton.jit
    def decode_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, e4m3_to_fp16(tl.load(x_ptr + i, mask=i < n, other=0)), mask=i < n)

    return encode_kernel, decode_kernel


def _encode(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _codec_kernels()[0][(-(-x.numel() // 256),)](x.flatten(), out, x.numel(), BLOCK=256)
    return out.view(x.shape)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, except that any NaN matches any NaN (torch's NaN payloads are not part of the format)."""
    nan = a.isnan()
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def test_decode_every_code_matches_torch(interpret):
    decoded = torch.empty(256, dtype=torch.float16)
    _codec_kernels()[1][(1,)](ALL_CODES, decoded, 256, BLOCK=256)
    expected = ALL_CODES.view(FP8).to(torch.float16)  # exact: every e4m3 value is an fp16 value
    assert _same_floats(decoded, expected)
    assert int(decoded.isnan().sum()) == 2 and float(decoded[0x7E]) == 448 and float(decoded[0x01]) == 2 ** -9
    assert decoded[0x80].item() == 0 and decoded[0x80].signbit()  # -0 stays negative


def _encode_cases() -> torch.Tensor:
    values = ALL_CODES.view(FP8).float()
    values = values[~values.isnan()]
    finite = torch.sort(values.unique()).values  # every e4m3 value, -448 .. 448
    ties = (finite[1:] + finite[:-1]) / 2  # exactly half-way: ties go to the even code
    near = torch.cat([torch.nextafter(ties, torch.full_like(ties, s)) for s in (-1e9, 1e9)])
    wide = torch.randn(4096) * torch.exp2(torch.randint(-14, 11, (4096,)).float())  # subnormals to 2**10
    beyond = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 500.0, 1e4, 3e38, float("inf")])
    tiny = torch.tensor([0.0, 2.0 ** -10, 2.0 ** -10 * 3, 1e-30, 2.0 ** -6 - 2.0 ** -11, 2.0 ** -6 - 2.0 ** -12])
    cases = torch.cat([finite, ties, near, wide, beyond, tiny])
    return torch.cat([cases, -cases])


def test_encode_matches_torch_with_saturation(interpret):
    x = _encode_cases()
    expected = x.clamp(-448, 448).to(FP8).view(torch.uint8)  # satfinite, as the sm_89+ cvt.rn.satfinite
    assert torch.equal(_encode(x), expected)
    assert torch.equal(_encode(torch.tensor([0.0, -0.0])), torch.tensor([0x00, 0x80], dtype=torch.uint8))
    assert _encode(torch.tensor([float("nan")])).item() & 0x7F == 0x7F


def test_encode_ties_go_to_even(interpret):
    # 1 + 1/16 lies half-way between 1.0 (code 0x38) and 1.125 (0x39), 1 + 3/16 between 0x39 and 0x3A; 1.5 and 2.5
    # times 2**-9 between the subnormal codes 1, 2 and 3.
    ties = torch.tensor([1.0625, 1.1875, 2.0 ** -9 * 1.5, 2.0 ** -9 * 2.5])
    assert _encode(ties).tolist() == [0x38, 0x3A, 0x02, 0x02]


def test_software_dequant_of_every_code(interpret):
    w = ALL_CODES.repeat(3).view(3, 256)[:, :200].contiguous().view(FP8)  # a partial tile along K
    scale = torch.tensor([[0.5, 2.0 ** -3]])
    got = fp8_quant.fp8_weight_dequant_triton(w, scale, torch.float32, software=True)
    assert _same_floats(got, fp8_quant.dequantize_fp8_weight_reference(w, scale))


@pytest.mark.parametrize("capability,software", [((8, 0), True), ((8, 6), True), ((8, 7), True), ((8, 9), False),
                                                 ((9, 0), False), ((12, 0), False)])
def test_wrappers_pick_software_below_sm89(monkeypatch, capability, software):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fp8_codec.software_fp8(torch.device("cuda", 0)) is software
    assert fp8_codec.software_fp8(torch.device("cuda", 0), forced=not software) is (not software)
    assert fp8_codec.software_fp8("cpu") is False  # the interpreter casts with torch's fp8 dtype


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
def test_recorded_launches_take_uint8_codes_below_sm89(no_interpret, arch):
    from metainfer_gen.kernels import indexer, sparse_attention
    from metainfer_gen.kernels.launch import record_launches

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    w_q, x_q = t(64, 256, dtype=FP8), t(16, 256, dtype=FP8)
    with record_launches(arch) as launches:
        fp8_quant.fp8_act_quant_triton(t(16, 256, dtype=torch.bfloat16))
        fp8_quant.fp8_weight_dequant_triton(w_q, t(1, 2))
        fp8_gemm.fp8_block_gemm_triton(x_q, t(16, 2), w_q, t(1, 2), torch.bfloat16)
        indexer.indexer_topk_triton(t(1, 4, 8, 16), t(1, 4, 8), t(1, 32, 16, dtype=FP8),
                                    t(1, 4, dtype=torch.int64), 4, 0.1)
        sparse_attention.sparse_mla_triton(t(4, 16, 96), t(64, 96, dtype=FP8), t(4, 8, dtype=torch.int64), 64, 0.1)
    soft = arch < 89
    fp8_args = [launches[0].args[1], launches[1].args[0], launches[2].args[0], launches[2].args[2],
                launches[3].args[2], launches[4].args[1]]
    assert [a.dtype for a in fp8_args] == [torch.uint8 if soft else FP8] * 6
    assert [launch.meta["SOFT_FP8"] for launch in launches] == [soft] * 5
    # Per-path configs that avoid spills (fp8_quant.WEIGHT_DEQUANT_WARPS, fp8_gemm.fp8_gemm_config).
    assert (launches[1].meta["num_warps"], launches[2].meta["num_warps"]) == ((32, 8) if soft else (16, 4))
