"""Measure the activation peak of a forward pass, on CUDA (the caching allocator's peak) or on the CPU.

The CPU allocator keeps no statistics torch exposes, so :class:`StorageTracker` counts tensor storages itself: a
``TorchDispatchMode`` sees every aten op the forward runs (composite ops such as ``einsum`` arrive decomposed, so
their internal copies are seen too); an output whose storage is not one of the op's inputs' is a new allocation,
counted until the last tensor viewing it is garbage-collected (a weak-reference callback). Storages made before the
mode (weights, the KV cache) are never counted. What it cannot see: scratch buffers a single kernel allocates and
frees internally (e.g. a BLAS workspace), which are small next to the tensors of a prefill chunk.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of the storages created while the mode is active.

    Attributes:
        live: bytes alive now; peak: the most alive at once since entering (or since ``reset_peak``).
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # data_ptr -> [nbytes, tracked tensors viewing it]
        self._watch: dict[int, weakref.ref] = {}  # keeps the weak references (and their callbacks) alive

    def reset_peak(self) -> None:
        self.peak = self.live

    def _release(self, ptr: int) -> None:
        entry = self._refs.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = _tensors(out)
        if not outputs:
            return out
        inputs = {t.untyped_storage().data_ptr() for t in _tensors(args)}
        if kwargs:
            inputs.update(t.untyped_storage().data_ptr() for t in _tensors(tuple(kwargs.values())))
        for t in outputs:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            entry = self._refs.get(ptr)
            if entry is None:
                if ptr in inputs or not storage.nbytes() or t.device.type == "meta":
                    continue  # a view of (or in-place write to) memory made outside the mode
                entry = self._refs[ptr] = [storage.nbytes(), 0]
                self.live += entry[0]
                if self.live > self.peak:
                    self.peak = self.live
            entry[1] += 1
            ref = weakref.ref(t, lambda r, ptr=ptr: self._forget(r, ptr))
            self._watch[id(ref)] = ref
        return out

    def _forget(self, ref, ptr: int) -> None:
        self._watch.pop(id(ref), None)
        self._release(ptr)


def _tensors(value) -> list[torch.Tensor]:
    """Tensors in an op's arguments or result (tensors, and lists/tuples of them, one level deep)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        found = []
        for v in value:
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif isinstance(v, (list, tuple)):
                found.extend(x for x in v if isinstance(x, torch.Tensor))
        return found
    return []


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each storage counted once)."""
    seen: dict[int, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@torch.inference_mode()
def measure_step_peak(model, starts: list[int], query_lens: list[int], block_size: int, dtype: torch.dtype,
                      device: torch.device, filled: bool = False) -> int:
    """Peak activation bytes of one engine step: sequence i holds ``starts[i]`` cached tokens and adds
    ``query_lens[i]``; the logits of every sequence's last token included. Building the step's attention
    metadata is counted (it grows with the context), the KV cache is not (the pool is sized separately).

    Every sequence's block table points at one scratch block per layer, so a step at any context needs almost no
    cache memory here; attention reads (and the new tokens overwrite) that block, which changes values, not
    shapes or allocations. ``filled`` gives each sequence blocks of its own, filled with N(0, 1) values, as a
    running engine's cache holds (a pool for the whole context, made before the measurement): on the scratch block
    every DeepSeek-V4 compressed entry reads the same few rows, so its indexer's scores tie everywhere.

    Args:
        model: the engine model (``forward(input_ids, meta, kv_caches)``, ``compute_logits``, ``cache_row_sizes`` or
            ``cache_layout``).
    Returns:
        bytes: on CUDA the caching allocator's reserved peak above what it held before (its rounding and
        fragmentation included; the cache is emptied first), elsewhere :class:`StorageTracker`'s peak.
    """
    from metainfer_gen.llm.attention_metadata import AttentionMetadata

    from metainfer_gen.llm.model_runner import cache_layout

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (sum(query_lens),), generator=generator).to(device)
    tables = [[0] * -(-(s + n) // block_size) for s, n in zip(starts, query_lens)]
    if filled:
        offsets = [0]
        for table in tables:
            offsets.append(offsets[-1] + len(table))
        tables = [list(range(a, b)) for a, b in zip(offsets, offsets[1:])]
        caches = [torch.randn(max(1, offsets[-1]), slots, 1, row, generator=generator).to(dtype=dtype, device=device)
                  for slots, row in cache_layout(model, block_size)]
    else:
        caches = [torch.zeros(1, slots, 1, row, dtype=dtype, device=device)
                  for slots, row in cache_layout(model, block_size)]
    last = torch.tensor(query_lens).cumsum(0).sub(1).to(device)

    def run():
        meta = AttentionMetadata.build(starts, query_lens, tables, block_size, device)
        hidden = model(ids, meta, caches)
        return model.compute_logits(hidden[last])

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_reserved(device) - base
        torch.cuda.empty_cache()
        return peak
    with StorageTracker() as tracker:
        run()
    return tracker.peak


def measure_prefill_peak(model, num_tokens: int, block_size: int, dtype: torch.dtype, device: torch.device,
                         context: int | None = None) -> int:
    """Peak activation bytes of a prefill chunk of ``num_tokens`` tokens ending at ``context`` tokens (default: a
    fresh sequence, context = num_tokens); see :func:`measure_step_peak`."""
    context = num_tokens if context is None else context
    return measure_step_peak(model, [context - num_tokens], [num_tokens], block_size, dtype, device)


def measure_decode_peak(model, num_seqs: int, context: int, block_size: int, dtype: torch.dtype,
                        device: torch.device, filled: bool = False) -> int:
    """Peak activation bytes of a decode step of ``num_seqs`` sequences, each at ``context`` tokens; see
    :func:`measure_step_peak`."""
    return measure_step_peak(model, [context - 1] * num_seqs, [1] * num_seqs, block_size, dtype, device, filled)
