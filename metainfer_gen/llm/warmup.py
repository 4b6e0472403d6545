"""Start-up warm-up: run the step shapes the scheduler can produce once, so no request pays a compile.

The engine's fused CPU paths (``kernels.rms_norm``, ``kernels.rope``, ...) are ``torch.compile``'d with static
shapes from a size threshold up (:class:`~metainfer_gen.kernels.common.CompiledPath`); the first step of each new
size stalls for the compile (1-3 s; 17-27 s for the first compile in a process). On the random-large DeepSeek-V3
of ``benchmarks/serve_llm.py`` exactly two graphs compile: the ``kv_a_layernorm`` RMSNorm on (2048, 512) and the
query RoPE on (2048, 8, 64), both at a full 2,048-token step (``max_num_batched_tokens``), which the first
64-prompt batch meets some seconds in. The warm-up runs

- one full-budget prefill step (``max_num_batched_tokens`` tokens, split into prompts the context allows), the one
  large size that recurs (every chunked-prefill step of a busy engine), which also builds the compiled prefill
  step's graph on a CPU (``llm/compiled_prefill.py``: one graph for every token count);
- every row bucket of every dense GEMM (:func:`metainfer_gen.kernels.gemm.warm_linear_buckets`: oneDNN builds a
  bf16 kernel per shape, about 1 ms each, and the buckets bound the shapes);
- decode steps over a ladder of batch sizes up to ``max_num_seqs`` (1, 2, 4, ..., ``max_num_seqs``), which also
  builds the compiled decode step's graph for each size on a CPU (``llm/compiled_decode.py``);

on scratch KV blocks (free and holding no cached prefix), outside the scheduler: no request, block, prefix-cache
entry or counter changes. Afterwards :meth:`LLMEngine.step` runs inside
:func:`~metainfer_gen.kernels.common.no_new_compiles`, so a size the warm-up did not run (a partial last chunk of
more than the threshold) runs eager instead of compiling. Dynamic shapes would compile once for all sizes, but
the dynamic-shape kernels measured slower than eager on this CPU (see ``CompiledPath``). Under tensor
parallelism every rank runs the same plan, so the collectives match.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from metainfer_gen.llm.scheduler import ScheduledSequence, SchedulerOutput
from metainfer_gen.llm.sequence import SamplingParams, Sequence
from metainfer_gen.llm.static_decode import batch_size_ladder

_GREEDY = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What :func:`warm_up` ran.

    Attributes:
        prefill_tokens: tokens of each prefill step run.
        decode_batches: sequences in each decode step run.
        num_graphs_compiled: graphs torch.compile built during the warm-up (dynamo's ``unique_graphs``).
        seconds: wall time of the warm-up.
        decode_refusal: why the decode steps run eager where the engine would compile them (the model's or the
            platform's reason: DeepSeek-V4's per-sequence attention, DSA, no C++ compiler, ...), so the server says
            it once; None when they compile, run CUDA graphs instead, or compiling was only turned off.
    """

    prefill_tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    num_graphs_compiled: int
    seconds: float
    decode_refusal: str | None = None


def prefill_split(num_tokens: int, max_prompt_len: int, block_size: int = 1) -> list[int]:
    """``num_tokens`` as prompt lengths of at most ``max_prompt_len`` (a step's tokens from several prompts), each
    but the last a whole number of ``block_size`` blocks when the cap allows one, so the prompts take
    ``ceil(num_tokens / block_size)`` blocks, no more than the tokens fill."""
    cap = max_prompt_len // block_size * block_size or max_prompt_len
    full, rest = divmod(num_tokens, cap)
    return [cap] * full + ([rest] if rest else [])


def warm_up(engine) -> WarmupReport:
    """Run the warm-up plan on ``engine`` (an :class:`~metainfer_gen.llm.engine.LLMEngine` with no request open).

    Raises:
        RuntimeError: requests are queued or running (warm up before serving).
    """
    if engine.has_unfinished_requests:
        raise RuntimeError("warm up before adding requests: the engine has unfinished requests")
    compiled = getattr(engine.runner.static, "compiled", None)  # the compiled decode step builds its graphs here
    prefill = getattr(engine.runner, "compiled_prefill", None)  # and the compiled prefill step its one graph
    with compiled.building() if compiled is not None else contextlib.nullcontext(), \
            prefill.building() if prefill is not None else contextlib.nullcontext():
        return _warm_up(engine)


def _warm_up(engine) -> WarmupReport:
    from torch._dynamo.utils import counters

    config, block_size = engine.config, engine.config.block_size
    scratch = engine.block_manager.scratch_blocks(engine.block_manager.num_blocks)
    capacity = len(scratch) * block_size
    start, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
    prefills = []
    budget = min(config.max_num_batched_tokens, capacity)
    prompts = prefill_split(budget, engine.max_model_len - 1, block_size) if budget > 0 else []
    while sum(-(-n // block_size) for n in prompts) > len(scratch):  # prompts shorter than a block each take one
        prompts.pop()
    if prompts:
        _run(engine, [(n, n) for n in prompts], scratch)
        prefills.append(sum(prompts))
    _warm_gemms(engine.model, config.max_num_batched_tokens)
    decodes = [n for n in batch_size_ladder(config.max_num_seqs) if n * block_size <= capacity]
    for num_seqs in decodes:
        _run(engine, [(block_size, 1)] * num_seqs, scratch)
    return WarmupReport(tuple(prefills), tuple(decodes), counters["stats"]["unique_graphs"] - graphs,
                        time.perf_counter() - start, _decode_refusal(engine))


def _decode_refusal(engine) -> str | None:
    """See :attr:`WarmupReport.decode_refusal` (the reason the engine audited at construction, op ``decode_step``)."""
    if engine.decode_path != "eager":
        return None
    from metainfer_gen.llm.compiled_decode import compiled_decode_refusal

    return compiled_decode_refusal(engine.model, engine.device, engine.config.tensor_parallel_size)


def _warm_gemms(model, max_rows: int) -> int:
    """Every row bucket of every dense weight the steps multiply (linears, LM head, each expert's gate-up and down
    views), so no step builds a oneDNN kernel (:func:`metainfer_gen.kernels.gemm.warm_linear_buckets`)."""
    from metainfer_gen.kernels.gemm import warm_linear_buckets

    return warm_linear_buckets((p for p in model.parameters() if p.ndim == 2), max_rows) + \
        warm_linear_buckets((w[0] for w in _expert_stacks(model)), max_rows)


def _expert_stacks(model):
    for module in model.modules():
        stacked = getattr(module, "_stacked_weights", None)
        if callable(stacked) and stacked() is not None:
            yield from stacked()


def _run(engine, shapes: list[tuple[int, int]], scratch: list[int]) -> None:
    """One step of sequences ``(length, new tokens)`` (the new tokens end the sequence, so every one samples),
    their KV written into ``scratch`` blocks."""
    block_size, blocks, vocab = engine.config.block_size, iter(scratch), engine.model.config.vocab_size
    out = SchedulerOutput(scratch=True)
    for length, num_new in shapes:
        seq = Sequence([(3 + 7 * i) % vocab for i in range(length)], _GREEDY, request_id="warmup")
        seq.block_table = [next(blocks) for _ in range(-(-length // block_size))]
        out.scheduled.append(ScheduledSequence(seq, length - num_new, num_new))
    engine.runner.run(out)
