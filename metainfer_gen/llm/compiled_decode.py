"""A compiled decode step on the CPU: one Inductor graph per batch-size bucket, the CPU's analog of CUDA graphs.

An eager decode step of a small model is mostly fixed cost: a few thousand aten calls a step, each a few
microseconds of dispatch, and a oneDNN bf16 GEMM of one row that costs 30-80 us because the weight is reordered into
the AMX layout on every call. The static decode buffers (:mod:`metainfer_gen.llm.static_decode`) give every step of
one batch size the same shapes, so the whole model forward can be compiled once per ladder size with
``torch.compile`` (Inductor, ``dynamic=False``):

- the norms, rotary, routing and residual adds fuse into a handful of C++ loops;
- with ``freezing`` the weights are constants of the graph, so each dense GEMM is prepacked for oneDNN once, at
  compile time (``mkldnn._linear_pointwise``), instead of reordered every call;
- the cache write, the paged attention and the routed experts stay the eager kernels, called from the graph as
  opaque custom ops (:mod:`metainfer_gen.llm.graph_ops`), so no host read or data-dependent shape enters the graph.

The graph for a size is built by the engine's warm-up (:meth:`LLMEngine.warmup`, which the server, the demo and
``warmup=True`` run), for every ladder size; an engine that was not warmed up runs its decode steps eager, so no
request ever waits for a compile. The block table is passed at its full width; the attention op trims it to the longest
context, so the table width is not a graph dimension. Freezing keeps a packed copy of every dense weight beside the
original (the prefill path still reads the originals): about 1x the attention, shared-expert and dense-MLP weights more
memory (the routed experts are not copied). A weight changed after the compile is not seen by the graph: build a new
engine.

Where it applies: :func:`compiled_decode_refusal` (audit op ``decode_step``, site ``llm.decode``).
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Callable

import torch

from metainfer_gen.kernels.audit_log import Refusal, record

_SITE = "llm.decode"
PREFILL_SITE = "llm.prefill"  # the compiled prefill step's audit site (llm/compiled_prefill.py)
ENFORCE_EAGER_ENV = "METAINFER_ENFORCE_EAGER"
# Inductor config while a decode graph compiles (``torch.compile(options=...)`` does not reach freezing). Not
# ``max_autotune``: its C++ AMX GEMM template ran a one-row GEMM in 7 us against oneDNN's 75 us, but autotuning
# every GEMM shape of every batch size took minutes per size on 2 cores.
COMPILE_CONFIG = {"freezing": True}


def compiled_decode_refusal(model, device: torch.device, tensor_parallel_size: int) -> str | None:
    """None when the decode step can be compiled for ``model`` on ``device``, else why not (audit wording)."""
    from metainfer_gen import platform
    from metainfer_gen.llm.layers.sparse_mla import SparseMLAttention

    refusal = getattr(model, "static_decode_refusal", None)  # a model's own reason (DeepSeek-V4)
    if refusal is not None:
        return refusal
    if device.type != "cpu":
        return f"device {device.type}: decode steps there replay CUDA graphs instead (static_decode)"
    if platform.capabilities().cxx_compiler is None:
        return "torch.compile on the CPU needs a C++ compiler (none found: install g++)"
    if tensor_parallel_size > 1:
        return f"tensor_parallel_size={tensor_parallel_size}: the all-reduces are not traced into a graph yet"
    if any(isinstance(m, SparseMLAttention) for m in model.modules()):
        return "sparse MLA (the DSA indexer's top-k) is not traced into a graph yet"
    if any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        return "fp8 weights: the CPU has no FP8 GEMM to compile (they are dequantised at load by default)"
    return None


def choose_decode_path(model, config, device: torch.device) -> str | None:
    """The engine's compiled steps, audited: "compiled" where :func:`compiled_decode_refusal` allows and nothing turns
    them off (``enforce_eager``, ``static_decode=False``, ``METAINFER_ENFORCE_EAGER``), else "eager"; None on a GPU
    (its static path is CUDA graphs, ``EngineConfig.static_decode``). The decode steps (one graph per batch size)
    and the prefill steps (:mod:`metainfer_gen.llm.compiled_prefill`) are compiled or not together: audit ops
    ``decode_step`` (site ``llm.decode``) and ``prefill_step`` (site ``llm.prefill``)."""
    if device.type != "cpu":
        return None
    enabled = not (config.enforce_eager or config.static_decode is False or enforce_eager_env())
    refusal = compiled_decode_refusal(model, device, config.tensor_parallel_size)
    record_step_path("prefill_step", PREFILL_SITE, refusal, enabled)
    return record_step_path("decode_step", _SITE, refusal, enabled)


def enforce_eager_env() -> bool:
    """``METAINFER_ENFORCE_EAGER`` set to 1/true/yes/on: no compiled steps, whatever the engine config says
    (the test suite sets it: compiling each tiny engine's steps would cost more than the tests)."""
    return os.environ.get(ENFORCE_EAGER_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def record_step_path(op: str, site: str, refusal: str | None, enabled: bool) -> str:
    """Audit which step runs (``op`` at ``site``: ``decode_step`` / ``prefill_step``); returns the path's name."""
    if enabled and refusal is None:
        record(op, site, "compiled", ())
        return "compiled"
    reason = refusal if enabled else (f"enforce_eager (or static_decode=False, or {ENFORCE_EAGER_ENV}=1): "
                                      f"compiled steps turned off")
    record(op, site, "eager", (Refusal("compiled", reason),))
    return "eager"


def own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A bound method whose function has a fresh copy of the code object (same behaviour, its own dynamo cache)."""
    func = method.__func__
    clone = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                               func.__closure__)
    return types.MethodType(clone, method.__self__)


class BuildWindow:
    """Graphs are compiled only inside :meth:`building` (the engine's warm-up opens it), never under a request."""

    _building = False

    @contextlib.contextmanager
    def building(self):
        """Within this block a step without a graph compiles one (the warm-up runs every shape it plans in it)."""
        self._building = True
        try:
            yield
        finally:
            self._building = False


class CompiledDecode(BuildWindow):
    """One ``torch.compile``'d decode forward per batch size.

    Args:
        forward: ``forward(input_ids, positions, slot_mapping, context_lens, block_tables) -> hidden``, tensors
            of ``size`` rows (int64; the table (size, W)), hidden (size, hidden) in the model dtype.
        num_sizes: how many sizes will be compiled (dynamo's recompile limit is raised to cover them).
    """

    def __init__(self, forward: Callable[..., torch.Tensor], num_sizes: int):
        import torch._dynamo.config as dynamo_config

        limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), num_sizes + 2))
        # No guards on the model's modules (checking them cost about 1.5 ms a step, and they do not change under a
        # running engine); the step's tensors' sizes pick the graph. Dynamo keeps its graphs per code object, so this
        # engine's forward gets a code object of its own: another engine's graphs (other weights) never match it.
        self._graph = torch.compile(own_code(forward), dynamic=False,
                                    options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self._sizes: set[int] = set()

    @property
    def sizes(self) -> list[int]:
        """Batch sizes compiled so far."""
        return sorted(self._sizes)

    def ready(self, size: int) -> bool:
        """Whether a step of ``size`` rows runs compiled: its graph is built, or is being built (inside
        :meth:`building`, which the engine's warm-up opens). Otherwise the step runs the eager path, audited: a
        graph is never built under a request, which would stall it for the compile."""
        if size in self._sizes or self._building:
            return True
        record("decode_step", _SITE, "eager", (Refusal("compiled", f"batch size {size} has no compiled graph: "
                                                                   f"graphs are built by LLMEngine.warmup() (the "
                                                                   f"server and the demo warm up)"),))
        return False


    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        size = tensors[0].shape[0]
        if size in self._sizes:
            return self._graph(*tensors)
        import torch._inductor.config as inductor_config

        with inductor_config.patch(COMPILE_CONFIG):  # this call compiles the size's graph
            out = self._graph(*tensors)
        self._sizes.add(size)
        return out
