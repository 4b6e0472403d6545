"""Fixtures and tolerances shared by the kernel tests.

Stated tolerances (``TOL``) compare a kernel with its torch reference: float32 agrees to rounding of a different
reduction order (atol = rtol = 1e-5); bfloat16 to one bf16 ulp of the result (2**-7 relative, doubled for a
rounding in each path: atol = rtol = 1.6e-2). Inputs are fresh ``torch.randn`` draws, never zeros.

Triton kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (numpy, about 0.5 ms per program): shapes stay
small. CUDA rows are the only ones skipped on a CPU-only machine.
"""

from __future__ import annotations

import zlib

import pytest
import torch

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
DTYPES = [torch.float32, torch.bfloat16]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only row: no GPU on this machine")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype or expected.dtype])


@pytest.fixture(autouse=True)
def _one_seed_per_test(request):
    # Fresh but reproducible draws: each test gets its own seed from its name.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(autouse=True)
def _no_strict_env(monkeypatch):
    monkeypatch.delenv("METAINFER_STRICT_FAST_PATH", raising=False)


def has_cpp_compiler() -> bool:
    """Whether the C++ CPU kernels can build here: ``$CXX`` (default ``c++``) is on PATH."""
    import os
    import shutil

    return shutil.which(os.environ.get("CXX", "c++")) is not None


def require_cpu_kernel(warm_up) -> None:
    """Skip without a C++ compiler (the torch paths run there); else build the kernel through ``warm_up`` (a
    ``kernels.*_cpu.warm_up``) and fail with its refusal if it does not build."""
    if not has_cpp_compiler():
        pytest.skip("no C++ compiler (apt-get install g++; .ci/run installs it): the torch paths run")
    reason = warm_up()
    assert reason is None, reason
