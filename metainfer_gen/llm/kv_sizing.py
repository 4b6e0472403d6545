"""Size the KV block pool: an explicit block count or GiB, or measured (profile the worst step, give the rest).

Measured sizing follows vLLM's ``determine_available_memory`` (profile a forward, then KV = budget - weights -
peak), with the budget stated instead of a ``gpu_memory_utilization`` fraction copied between machines, and a
margin that is a stated share of that budget. vLLM profiles one prefill of ``max_num_batched_tokens`` fresh
tokens; here two steps are profiled and the larger peak kept: the largest prefill chunk at the longest context
(its attention reads ``max_model_len`` cached tokens) and the largest decode batch (``min(max_num_seqs,
max_num_batched_tokens)`` sequences) at the longest context. On CUDA the allocator's cache is emptied before the
free memory is read and the peak is the allocator's reserved peak, so its rounding is accounted for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metainfer_gen.llm.memory_profile import measure_decode_peak, measure_prefill_peak, tensor_bytes

MIB = 2**20


@dataclass(frozen=True, slots=True)
class KVPoolSizing:
    """How the pool was sized; bytes per rank (0 where a field does not apply to ``source``).

    Attributes:
        source: "num_kv_blocks", "kv_cache_memory_gib" or "measured".
        num_blocks, bytes_per_block: the pool.
        budget, weights, activation_peak, margin: the measured split; activation_peak is the larger of
            prefill_peak (a ``profiled_tokens`` chunk ending at ``profiled_context`` tokens) and decode_peak
            (``decode_seqs`` sequences at ``profiled_context`` tokens).
        capped: True when fewer blocks than memory allows were kept (``max_num_seqs`` x ``max_model_len``).
    """

    source: str
    num_blocks: int
    bytes_per_block: int
    budget: int = 0
    weights: int = 0
    activation_peak: int = 0
    margin: int = 0
    profiled_tokens: int = 0
    capped: bool = False
    profiled_context: int = 0
    prefill_peak: int = 0
    decode_peak: int = 0
    decode_seqs: int = 0

    @property
    def worst_step(self) -> str:
        """The profiled step with the larger peak: the prefill chunk or the decode batch."""
        return (f"decode of {self.decode_seqs} x {self.profiled_context} tokens" if self.decode_peak > self.prefill_peak
                else f"{self.profiled_tokens}-token prefill at {self.profiled_context} tokens")

    def describe(self) -> str:
        """One line with the numbers, for refusals and logs."""
        pool = f"{self.num_blocks} blocks = {self.num_blocks * self.bytes_per_block / MIB:.1f} MiB"
        if self.source != "measured":
            return f"KV pool {pool} (set by {self.source})"
        return (f"KV pool {pool} from a {self.budget / MIB:.1f} MiB budget - weights {self.weights / MIB:.1f} MiB - "
                f"measured peak {self.activation_peak / MIB:.1f} MiB ({self.worst_step}) - "
                f"margin {self.margin / MIB:.1f} MiB" + (" (capped by max_num_seqs x max_model_len)"
                                                          if self.capped else ""))


def default_budget(model, device: torch.device, utilization: float | None = None) -> int:
    """Bytes the engine may use when no budget is given: CUDA free memory (after emptying the allocator's cache)
    plus what this process holds allocated;
    on the CPU the weights plus a quarter of ``MemAvailable`` (the RAM is shared with everything else).
    ``utilization`` (vLLM's ``--gpu-memory-utilization``, read as a share of the free memory plus what this process
    holds) takes that share instead, on either device."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks the allocator caches but does not use count as free
        free, _ = torch.cuda.mem_get_info(device)
        held = free + torch.cuda.memory_allocated(device)
        return held if utilization is None else int(utilization * held)
    available = 4 * 2**30
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if utilization is not None:
        return int(utilization * (available + tensor_bytes(model)))
    return tensor_bytes(model) + available // 4


def size_kv_pool(model, config, *, max_model_len: int, dtype: torch.dtype, device: torch.device,
                 bytes_per_block: int) -> KVPoolSizing:
    """The pool for ``config`` (an :class:`~metainfer_gen.llm.config.EngineConfig`).

    Under tensor parallelism every rank profiles and the smallest pool wins, so block tables agree.
    A model whose blocks take no bytes (DeepSeek-V4 with only sliding layers: its windows are per sequence) gets
    the ``max_num_seqs`` x ``max_model_len`` blocks it can use.
    Raises:
        ValueError: the measured split leaves no room for even one block (the message has the numbers).
    Profiling runs both worst steps on one scratch block per layer
    (:func:`~metainfer_gen.llm.memory_profile.measure_step_peak`), so it needs no KV memory of its own.
    """
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    per_block = max(1, bytes_per_block)  # a divisor: 0 where the pool holds nothing
    if config.num_kv_blocks:
        return KVPoolSizing("num_kv_blocks", config.num_kv_blocks, bytes_per_block)
    if config.kv_cache_memory_gib:
        blocks = max(1, min(int(config.kv_cache_memory_gib * 2**30) // per_block, useful))
        return KVPoolSizing("kv_cache_memory_gib", blocks, bytes_per_block)
    tokens = min(config.max_num_batched_tokens, max_model_len)
    seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
    prefill = measure_prefill_peak(model, tokens, config.block_size, dtype, device, context=max_model_len)
    decode = measure_decode_peak(model, seqs, max_model_len, config.block_size, dtype, device)
    peak = max(prefill, decode)
    weights = tensor_bytes(model)
    budget = int(config.memory_budget_gib * 2**30) if config.memory_budget_gib else \
        default_budget(model, device, config.gpu_memory_utilization)
    margin = int(config.kv_memory_margin * budget)
    by_memory = (budget - weights - peak - margin) // per_block
    tp = getattr(model, "tp", None)
    if tp is not None and tp.enabled:
        gathered = tp.all_gather_last(torch.tensor([[float(by_memory)]], dtype=torch.float64, device=device))
        by_memory = int(gathered.min().item())
    if by_memory < 1:
        raise ValueError(f"no memory left for the KV cache: budget {budget / MIB:.1f} MiB - weights "
                         f"{weights / MIB:.1f} MiB - measured peak {peak / MIB:.1f} MiB (the larger of a "
                         f"{tokens}-token prefill and a decode of {seqs} sequences, at {max_model_len} tokens) - "
                         f"margin {margin / MIB:.1f} MiB < one block ({bytes_per_block} bytes); raise "
                         f"memory_budget_gib or lower max_num_batched_tokens")
    return KVPoolSizing("measured", int(min(by_memory, useful)), bytes_per_block, budget=budget, weights=weights,
                        activation_peak=peak, margin=margin, profiled_tokens=tokens, capped=by_memory > useful,
                        profiled_context=max_model_len, prefill_peak=prefill, decode_peak=decode, decode_seqs=seqs)
