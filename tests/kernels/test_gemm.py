"""The bucketed linear: exact against F.linear, buckets bounded, chosen per platform at load and audited."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metainfer_gen import platform
from metainfer_gen.kernels import audit
from metainfer_gen.kernels.gemm import (LINEAR, bucket_rows, bucketed_bmm, linear_bucketed, linear_buckets,
                                        matmul_path, record_matmul_path, select_linear)


def test_buckets_cover_every_row_count_with_bounded_waste():
    for m in range(1, 5000):
        b = bucket_rows(m)
        assert b >= m
        assert m <= 32 or b <= 1.5 * m + 1e-9 or m <= 64  # 33 -> 64 is the worst case
        assert bucket_rows(b) == b  # a bucket is its own bucket
    assert len(linear_buckets(2048)) == len({bucket_rows(m) for m in range(1, 2049)}) <= 40
    assert linear_buckets(2048)[-1] == 2048 and linear_buckets(5)[-1] == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 33, 700, 2049])
def test_bucketed_linear_equals_f_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    out = linear_bucketed(x, w, b)
    assert out.shape == (rows, 40) and out.dtype == dtype and out.is_contiguous()
    # Padding rows never touch real rows: bit-equal to the unpadded GEMM up to the kernel's blocking.
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)
    x3 = x.view(1, rows, 48)
    torch.testing.assert_close(linear_bucketed(x3, w), F.linear(x3, w), atol=2e-2, rtol=1e-2)


def test_bucketed_bmm_equals_bmm():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 37, 64, generator=g).bfloat16()
    b = torch.randn(8, 64, 48, generator=g).bfloat16()
    torch.testing.assert_close(bucketed_bmm(a, b), torch.bmm(a, b), atol=2e-2, rtol=1e-2)
    assert bucketed_bmm(a, b).shape == (8, 37, 48)
    a32, b32 = a.float(), b.float()
    torch.testing.assert_close(bucketed_bmm(a32, b32), torch.bmm(a32, b32))


def test_the_choice_follows_dtype_and_device_and_is_audited():
    with audit() as report:
        bf16 = select_linear("cpu", torch.bfloat16, site="test.linear")
        fp32 = select_linear("cpu", torch.float32, site="test.linear")
    assert bf16 is linear_bucketed and fp32 is F.linear
    entries = {e.path: e for e in report.entries if e.site == "test.linear"}
    assert set(entries) == {"bucketed", "torch"}
    assert "fp32" in entries["torch"].refusals[0].reason
    impl, refusals = LINEAR.select(torch.empty(2, 4, device="meta"), torch.empty(4, 4, device="meta"))
    assert impl.name == "torch" and refusals == ()  # a CPU kernel is no fast path not taken on another device


def test_engine_layers_take_the_chosen_gemm(tmp_path):
    from metainfer_gen.llm.layers.linear import ColumnParallelLinear, configure_gemms

    layer = ColumnParallelLinear(16, 8).to(torch.bfloat16)
    assert configure_gemms(layer) == 1 and layer.gemm is linear_bucketed
    layer.float()
    configure_gemms(layer)
    assert layer.gemm is F.linear


def test_native_dtype_follows_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(platform.DTYPE_ENV, raising=False)
    for matrix, dtype, path in (("amx_bf16", torch.bfloat16, "oneDNN AMX-BF16"),
                                ("avx512_bf16", torch.bfloat16, "oneDNN AVX512-BF16"), ("", torch.float32, None)):
        caps = platform.Capabilities(device_kind=platform.DeviceKind.CPU, bf16=bool(matrix), cpu_matrix=matrix,
                                     cpu_capability="AVX512")
        with platform.override_capabilities(caps):
            assert platform.native_dtype("cpu") == dtype
            name, refused = matmul_path("cpu", torch.float32)
            assert name == "AVX-512 fp32"
            assert (refused is None) == (not matrix)  # fp32 on a bf16 CPU is a fast path not taken
            if matrix:
                assert matmul_path("cpu", torch.bfloat16) == (path, None)
            else:
                assert "emulated" in matmul_path("cpu", torch.bfloat16)[0]
    assert platform.native_dtype("cuda") == torch.bfloat16
    monkeypatch.setenv(platform.DTYPE_ENV, "float32")
    assert platform.native_dtype("cuda") == torch.float32
    monkeypatch.setenv(platform.DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match="METAINFER_DEFAULT_DTYPE"):
        platform.native_dtype("cpu")


def test_an_fp32_run_on_a_bf16_cpu_is_audited_as_a_fast_path_not_taken():
    amx = platform.Capabilities(device_kind=platform.DeviceKind.CPU, bf16=True, cpu_matrix="amx_bf16",
                                cpu_capability="AVX512")
    with platform.override_capabilities(amx), audit() as report:
        assert record_matmul_path("cpu", torch.float32, site="test.engine") == "AVX-512 fp32"
        assert record_matmul_path("cpu", torch.bfloat16, site="test.engine") == "oneDNN AMX-BF16"
    entries = {e.path: e for e in report.entries if e.site == "test.engine"}
    assert not entries["oneDNN AMX-BF16 (bfloat16)"].refusals
    (refusal,) = entries["AVX-512 fp32 (float32)"].refusals
    assert refusal.implementation == "bfloat16" and "amx_bf16" in refusal.reason
