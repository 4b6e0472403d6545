"""Dense GEMMs on the matrix unit the platform has, with the row count of each call rounded up to a bucket.

On a CPU, a bf16 ``F.linear``/``bmm`` goes to oneDNN, which builds (JIT-compiles) a kernel for every new shape and
caches it. Prefill chunks, MoE expert runs and decode batches give a different row count almost every call, so
without care nearly every call pays the build: on a 2-core Xeon with AMX-BF16, a (M, 384) x (384, 384) bf16 GEMM
with M drawn from 300..700 ran at 0.10 TFLOP/s on first sight of each M and 0.92-1.18 TFLOP/s once its kernel was
cached (docs/kernels.md, "linear"). ``bucketed`` pads the rows of ``x`` up to :func:`bucket_rows` so that a few dozen
shapes cover every call, all built once (the engine's warm-up runs each bucket), and slices the result back.

Implementations of the ``linear`` op (``y = x @ W.T (+ b)``, x (M, K), W (N, K)):

- ``bucketed`` (CPU, bfloat16/float16, M not already a bucket): rows padded with zeros to the bucket, one
  ``F.linear``, the first M rows returned (a contiguous view). Exact: padding rows never touch real rows.
- ``torch`` (reference, always applies): ``F.linear``. fp32 goes here on a CPU (MKL's sgemm builds nothing per
  shape), and every GPU call (cuBLAS picks its kernels without a per-shape build).

The choice is made once per layer at load (:func:`select_linear`), not per call, and recorded in the audit.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["LINEAR", "bucket_rows", "bucketed_bmm", "bucketed_supports", "linear_bucketed", "linear_buckets",
           "matmul_path", "record_matmul_path", "select_linear", "warm_linear_buckets"]


def bucket_rows(m: int) -> int:
    """The row count a GEMM of ``m`` rows is padded to: powers of two up to 32, multiples of 32 up to 512,
    of 128 up to 2048, of 512 beyond. At most 1.5x the rows above 32 (33 -> 64 is the worst), 40 shapes up to 2048."""
    if m <= 32:
        return 1 << max(0, (m - 1).bit_length())
    step = 32 if m <= 512 else 128 if m <= 2048 else 512
    return -(-m // step) * step


def linear_buckets(max_rows: int) -> list[int]:
    """Every bucket a GEMM of 1..``max_rows`` rows can be padded to, ascending (what a warm-up runs)."""
    out, m = [], 1
    while True:
        b = bucket_rows(m)
        out.append(b)
        if b >= max_rows:
            return out
        m = b + 1


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (..., M, K) with zero rows appended along M up to ``rows``."""
    m = x.shape[-2]
    padded = x.new_empty(*x.shape[:-2], rows, x.shape[-1])
    padded[..., :m, :].copy_(x)
    padded[..., m:, :].zero_()
    return padded


def linear_bucketed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with x's rows padded to :func:`bucket_rows`; x (M, K) or (..., K) -> (..., N)."""
    if torch.compiler.is_compiling():  # a compiled graph has its own GEMM per shape (and no guard on the rows)
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    rows = bucket_rows(m)
    if rows == m or m == 0:
        return F.linear(x, weight, bias)
    return F.linear(_pad_rows(x2, rows), weight, bias)[:m].view(*lead, weight.shape[0])


def bucketed_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` for a (B, M, K), b (B, K, N) with M padded to :func:`bucket_rows` on a CPU in bf16/fp16
    (the same per-shape kernel builds as :func:`linear_bucketed`); plain ``bmm`` elsewhere."""
    if torch.compiler.is_compiling() or a.device.type != "cpu" or a.dtype == torch.float32:
        return torch.bmm(a, b)
    m = a.shape[1]
    rows = bucket_rows(m)
    if rows == m or m == 0:
        return torch.bmm(a, b)
    return torch.bmm(_pad_rows(a, rows), b)[:, :m]


def bucketed_supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    if x.device.type != "cpu":
        return f"device {x.device.type}: the GPU's GEMM library builds no kernel per shape"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {x.dtype}: fp32 GEMMs on a CPU build no kernel per shape (MKL sgemm)"
    if not torch.backends.mkldnn.is_available():
        return "torch built without oneDNN (mkldnn)"
    return None


def _example(device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(700, 384, generator=g).to(device, dtype)  # a prefill chunk's tail: 700 rows
    w = torch.randn(384, 384, generator=g).to(device, dtype)
    return (x, w, None), {}


LINEAR = register_op(Op("linear", "dense linear y = x W^T (+ b): rows padded to a bucket on oneDNN", _example))
LINEAR.register("bucketed", linear_bucketed, bucketed_supports, devices=("cpu",),
                description="rows padded to a bucket, so oneDNN builds each bf16 kernel once")
LINEAR.register("torch", F.linear, description="F.linear")


@torch.inference_mode()
def warm_linear_buckets(weights, max_rows: int) -> int:
    """Run a GEMM of every bucket of 1..``max_rows`` rows (:func:`linear_buckets`) once for each distinct weight shape
    (K, N, dtype, device) among ``weights`` (2-D dense tensors; others are skipped), so that oneDNN has built every
    kernel a later step can ask for. Returns the number of GEMMs run (about 40 per shape at 2,048 rows, ~1 ms
    each on first sight)."""
    seen, count = set(), 0
    for w in weights:
        key = (tuple(w.shape), w.dtype, w.device)
        if w.ndim != 2 or key in seen or not w.is_floating_point() or w.element_size() < 2 or w.is_meta:
            continue
        seen.add(key)
        x = torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device)
        if bucketed_supports(x, w) is not None:
            continue
        for rows in linear_buckets(max_rows):
            F.linear(x.expand(rows, -1).contiguous(), w)
            count += 1
    return count


def matmul_path(device, dtype) -> tuple[str, str | None]:
    """The GEMM hardware path a ``dtype`` matmul takes on ``device``, and why a faster one is not taken (None when
    it is the fastest here).

    Names: ``"CUDA tensor cores"``, ``"oneDNN AMX-BF16"``, ``"oneDNN AVX512-BF16"``, ``"AVX-512 fp32"``,
    ``"AVX2 fp32"``, ``"bf16 emulated (fp32)"``. On a CPU with bf16 matrix hardware an fp32 run is reported as a fast
    path not taken (the bf16 path runs 3-8x the fp32 one on these CPUs' GEMMs).
    """
    from metainfer_gen.platform import capabilities

    caps = capabilities()
    if str(device).startswith("cuda"):
        return ("CUDA tensor cores" if dtype in (torch.bfloat16, torch.float16) else "CUDA fp32 (tf32 off)"), (
            None if dtype != torch.float32
            else "float32 on a GPU: bfloat16 runs on its tensor cores (--dtype bfloat16)")
    vector = "AVX-512 fp32" if caps.cpu_capability.startswith("AVX512") else f"{caps.cpu_capability or 'scalar'} fp32"
    matrix = {"amx_bf16": "oneDNN AMX-BF16", "avx512_bf16": "oneDNN AVX512-BF16"}.get(caps.cpu_matrix)
    if dtype == torch.bfloat16:
        return (matrix, None) if matrix else ("bf16 emulated (fp32)", "this CPU has no AMX-BF16 or AVX512-BF16: "
                                              "bf16 is converted to fp32 (use --dtype float32)")
    if dtype == torch.float16:
        return "fp16 emulated", "fp16 matmuls on a CPU are about 400x slower than bf16 (use --dtype bfloat16)"
    if matrix:
        return vector, (f"float32 on a CPU with {caps.cpu_matrix}: {matrix} runs bf16 GEMMs 3-8x faster at "
                        f"prefill sizes, the engine 1.6-1.9x under load "
                        f"(--dtype bfloat16, the default here)")
    return vector, None


def record_matmul_path(device, dtype: torch.dtype, site: str = "llm.engine") -> str:
    """Record the run dtype's GEMM hardware path (:func:`matmul_path`) in the fast-path audit (op ``matmul``), with
    the faster path refused when there is one (fp32 on a CPU with AMX-BF16 or AVX512-BF16); returns its name."""
    from metainfer_gen.kernels.audit_log import Refusal, record

    name, refused = matmul_path(device, dtype)
    better = "bfloat16" if dtype != torch.bfloat16 else "a native bf16 CPU or GPU"
    record("matmul", site, f"{name} ({str(dtype).removeprefix('torch.')})",
           () if refused is None else (Refusal(better, refused),))
    return name


def select_linear(device: torch.device | str, dtype: torch.dtype, *, site: str = "llm.linear"
                  ) -> Callable[..., torch.Tensor]:
    """The ``linear`` implementation for weights of ``dtype`` on ``device``, chosen once (at load) from an example
    of that dtype and device, and recorded in the audit at ``site`` (with the refusals of faster ones)."""
    from metainfer_gen.kernels.audit_log import record

    x = torch.empty(3, 8, dtype=dtype, device=device)
    impl, refusals = LINEAR.select(x, torch.empty(8, 8, dtype=dtype, device=device))
    record(LINEAR.name, site, impl.name, refusals)
    return impl.fn
