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
def measure_prefill_peak(model, num_tokens: int, block_size: int, dtype: torch.dtype,
                         device: torch.device) -> int:
    """Peak activation bytes of one prefill of ``num_tokens`` tokens (a fresh sequence) plus the logits of its
    last token, the largest step the scheduler can run. The scratch KV cache it writes is not counted (the KV
    pool is sized separately).

    Args:
        model: the engine model (``forward(input_ids, meta, kv_caches)``, ``compute_logits``, ``cache_row_size``).
    Returns:
        bytes, from ``torch.cuda.max_memory_allocated`` on CUDA, from :class:`StorageTracker` elsewhere.
    """
    from metainfer_gen.llm.attention_metadata import AttentionMetadata

    num_blocks = -(-num_tokens // block_size)
    caches = [torch.zeros(num_blocks, block_size, 1, model.cache_row_size, dtype=dtype, device=device)
              for _ in model.model.layers]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=generator).to(device)
    meta = AttentionMetadata.build([0], [num_tokens], [list(range(num_blocks))], block_size, device)

    def run():
        hidden = model(ids, meta, caches)
        return model.compute_logits(hidden[-1:])

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with StorageTracker() as tracker:
        run()
    return tracker.peak
