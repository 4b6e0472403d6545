"""Shared pieces of the kernel files: refusal checks, lazy Triton kernels, and the torch.compile fast path.

Every check returns ``None`` when it passes or a reason string that names the offending argument and what would be
accepted, so that the audit reads as a diagnosis (``"x is not contiguous (stride (1, 64)); the Triton kernel reads
whole rows"``).

Triton is imported only inside :func:`lazy_triton_kernel` builders, so the package imports and works without it.
Kernels are built once per interpreter setting because Triton decides between compiling and interpreting when a
function is decorated (``triton.jit`` reads ``knobs.runtime.interpret``), and tests flip ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

import torch

from metainfer_gen import platform

__all__ = [
    "COMPILED_MIN_NUMEL",
    "FLOAT_DTYPES",
    "MAX_FUSED_ROW_BYTES",
    "CompiledPath",
    "compiles_frozen",
    "contiguous_refusal",
    "dtype_refusal",
    "first_refusal",
    "lazy_triton_kernel",
    "no_new_compiles",
    "pow2_at_least",
    "row_bytes_refusal",
    "triton_refusal",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# One Triton program holds a whole row in registers; past 64 KB it spills (the limit of Triton's layer-norm
# tutorial, 05-layer-norm.py: "This layer norm doesn't support feature dim >= 64KB").
MAX_FUSED_ROW_BYTES = 65536

# Below this many elements a torch.compile'd call is no faster than eager on the CPU: the compiled call costs
# 40-100 us of guards and wrapper (measured on this project's 2-core CI machine, one thread: rms_norm, adaLN and the
# gated residual were 1.5-2.5x slower compiled at 8K elements, even at 256K, and 1.3-2.3x faster from 1M elements).
COMPILED_MIN_NUMEL = 1 << 20


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pow2_at_least(x: int, floor: int = 16) -> int:
    """The smallest power of two >= max(x, floor): a Triton block size (``tl.dot`` needs dims >= 16)."""
    return max(floor, 1 << max(x - 1, 0).bit_length())


def first_refusal(*reasons: str | None) -> str | None:
    """The first non-None reason (checks written as a flat list, cheapest first)."""
    for reason in reasons:
        if reason is not None:
            return reason
    return None


def dtype_refusal(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> str | None:
    if tensor.dtype in allowed:
        return None
    names = ", ".join(_dtype_name(d) for d in allowed)
    return f"{name} dtype {_dtype_name(tensor.dtype)} not in ({names})"


def contiguous_refusal(name: str, tensor: torch.Tensor | None) -> str | None:
    if tensor is None or tensor.is_contiguous():
        return None
    return f"{name} is not contiguous (shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())})"


def row_bytes_refusal(name: str, row_elements: int, element_size: int) -> str | None:
    num_bytes = row_elements * element_size
    if num_bytes <= MAX_FUSED_ROW_BYTES:
        return None
    return (f"{name} row of {row_elements} elements is {num_bytes} bytes, over the {MAX_FUSED_ROW_BYTES}-byte "
            f"one-program-per-row limit")


def _grad_refusal(tensors: tuple[torch.Tensor | None, ...]) -> str | None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return "an input requires grad and the kernel has no backward (run under torch.no_grad/inference_mode)"
    return None


def triton_refusal(*tensors: torch.Tensor | None) -> str | None:
    """Why a Triton kernel cannot take these tensors here: triton missing, no GPU, wrong device, autograd.

    Under ``TRITON_INTERPRET=1`` CPU tensors are accepted (the interpreter runs them; correctness only, about
    0.5 ms per program), which is how the Triton kernels are tested on a CPU-only machine.
    """
    status = platform.triton_status()
    if status.mode is platform.TritonMode.UNAVAILABLE:
        return status.reason
    present = [t for t in tensors if t is not None]
    if status.mode is platform.TritonMode.COMPILE:
        for t in present:
            if t.device.type != "cuda":
                return f"tensor on {t.device}; Triton kernels take CUDA/ROCm tensors"
    devices = {t.device for t in present}
    if len(devices) > 1:
        return f"inputs on several devices {sorted(str(d) for d in devices)}"
    return _grad_refusal(tuple(present))


def lazy_triton_kernel(builder: Callable[[], Any]) -> Callable[[], Any]:
    """Wrap ``builder`` (which imports triton and returns ``@triton.jit`` functions) so that it runs on first use,
    once per ``TRITON_INTERPRET`` setting."""
    cache: dict[bool, Any] = {}
    lock = threading.Lock()

    @functools.wraps(builder)
    def get() -> Any:
        interpret = platform.triton_interpret_requested()
        with lock:
            if interpret not in cache:
                cache[interpret] = builder()
            return cache[interpret]

    return get


def _sum_combine(tl) -> Any:
    """The combine function for ``tl.reduce`` sums, usable both compiled and interpreted.

    ``tl.sum`` is itself a ``@triton.jit`` function, decorated when ``triton.language`` is first imported; if that
    happened with ``TRITON_INTERPRET`` unset (diffusers imports triton early), the interpreter later refuses to call
    it ("Cannot call @triton.jit'd outside of the scope of a kernel"). ``tl.reduce`` is patched by the interpreter,
    which recognises ``_sum_combine`` and sums in numpy, so kernels reduce with ``tl.reduce(x, 0, add)``.
    """
    combine = getattr(getattr(tl, "standard", None), "_sum_combine", None)
    if combine is not None:
        return combine
    import triton

    @triton.jit
    def add(a, b):
        return a + b

    return add


def _max_combine(tl) -> Any:
    """The combine function for ``tl.reduce`` taking the maximum, recognised by the interpreter like
    :func:`_sum_combine` (``tl.max`` has the same import-order failure as ``tl.sum``)."""
    combine = getattr(getattr(tl, "standard", None), "_elementwise_max", None)
    if combine is not None:
        return combine
    import triton

    @triton.jit
    def maximum(a, b):
        return tl.maximum(a, b)

    return maximum


_compile_state = threading.local()


@contextlib.contextmanager
def no_new_compiles():
    """In this block, on this thread, compiled paths run only the input signatures they have already compiled;
    a new one runs eager and the audit says why.

    An engine that warmed its compiled paths at start-up steps inside this block, so no request ever waits the
    1-27 s of a compile for a shape the warm-up did not foresee. Thread-local: another thread's work (a video
    pipeline beside the LLM in the demo) still compiles what it meets.
    """
    previous = compiles_frozen()
    _compile_state.frozen = True
    try:
        yield
    finally:
        _compile_state.frozen = previous


def compiles_frozen() -> bool:
    """True inside :func:`no_new_compiles` on this thread (part of the dispatch cache's environment key)."""
    return getattr(_compile_state, "frozen", False)


def _signature(args: tuple, kwargs: dict) -> tuple:
    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.stride(), value.dtype, value.device.type, value.requires_grad)
        if isinstance(value, (int, float, bool, str, type(None))):
            return value
        return type(value).__name__

    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(one(a) for a in args),
            tuple((k, one(v)) for k, v in sorted(kwargs.items())))


class CompiledPath:
    """``torch.compile(reference, dynamic=False)`` built on first use, with the conditions under which it pays.

    Static shapes, because the dynamic-shape kernels measured slower than eager on this CPU. Each new input
    signature compiles once (about 1-2 s; 17-27 s for the very first compile in a process with a cold cache) and
    dynamo gives up after ``torch._dynamo.config.recompile_limit`` signatures of one function, silently running
    eager from then on. This class counts the signatures it has sent and refuses beyond the limit, so the audit says
    so instead.

    Args:
        reference: the torch function to compile (its first tensor argument decides the size threshold).
        min_numel: refuse below this many elements of the first argument (eager is as fast there).
    """

    def __init__(self, reference: Callable[..., Any], min_numel: int = COMPILED_MIN_NUMEL):
        self.reference = reference
        self.min_numel = min_numel
        self._compiled: Callable[..., Any] | None = None
        self._signatures: set[tuple] = set()
        self._lock = threading.Lock()

    def refusal(self, *args: Any, **kwargs: Any) -> str | None:
        """None when the compiled path applies to these inputs, else why not."""
        first = args[0]
        device = first.device.type
        if device == "cpu":
            caps = platform.capabilities()
            if caps.cxx_compiler is None:
                return "torch.compile on CPU needs a C++ compiler (none found: install g++)"
        elif device == "cuda":
            if platform.triton_installed() is None:
                return "torch.compile on CUDA needs triton (not installed)"
        else:
            return f"torch.compile path runs on cpu/cuda tensors, not {device}"
        if first.numel() < self.min_numel:
            return f"{first.numel()} elements, below {self.min_numel} where compiled beats eager"
        signature = _signature(args, kwargs)
        if signature not in self._signatures:
            if compiles_frozen():
                return ("a new input signature after warm-up (no_new_compiles): eager, so no request waits for a "
                        "compile")
            import torch._dynamo.config as dynamo_config

            limit = int(getattr(dynamo_config, "recompile_limit", getattr(dynamo_config, "cache_size_limit", 8)))
            if len(self._signatures) >= limit:
                return (f"already compiled for {len(self._signatures)} input signatures (dynamo recompile_limit "
                        f"{limit}); a new shape would run eager inside torch.compile")
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._compiled is None:
                self._compiled = torch.compile(self.reference, dynamic=False)
            self._signatures.add(_signature(args, kwargs))
        return self._compiled(*args, **kwargs)
