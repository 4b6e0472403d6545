"""Paged KV cache: vectorised slot mapping and the store of new keys/values into their pages.

The cache is ``(num_blocks, block_size, H, D)`` per layer (vLLM's flash layout; an MLA latent cache is the same
with H = 1 and no value cache). Token ``t`` of sequence ``q`` at position ``p`` lives in slot::

    slot = block_tables[q, p // block_size] * block_size + p % block_size

:func:`compute_slot_mapping` evaluates that for a whole batch in a few tensor ops (no Python loop over tokens);
:func:`positions_from_lengths` builds the ``(positions, seq_indices)`` of a prefill/decode batch from per-sequence
lengths, also without a loop. Slot ``-1`` marks a padding token that is not stored (CUDA-graph padding).

The Triton store copies raw 32-bit words, so one compiled kernel serves bf16, fp16, fp32 and fp8 caches
bit-exactly (Triton cannot even name fp8e4nv below sm89, but it can move its bytes). It therefore needs each
token's (H, D) row to be a whole number of words and 4-byte aligned, and the key already in the cache dtype;
otherwise the torch reference (a dtype cast, then an ``index_copy_`` of the bytes) runs. The reference is already a
single memory pass on the CPU, so there is no compiled path for this op.

Sources: nano-vllm ``engine/block_manager.py`` and ``layers/attention.py`` (``store_kvcache`` Triton kernel, slot
mapping built in ``model_runner.prepare_prefill``), vLLM ``reshape_and_cache_flash`` (slot -1 = skip).
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.common import contiguous_refusal, first_refusal, lazy_triton_kernel, triton_refusal
from metainfer_gen.kernels.launch import launch
from metainfer_gen.kernels.registry import Op, register_op

__all__ = ["compute_slot_mapping", "positions_from_lengths", "store_kv_cache", "store_kv_cache_reference"]

_WORD = 4  # bytes moved per lane by the Triton store


def positions_from_lengths(context_lens: torch.Tensor, query_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and owning sequence of every new token in a batch, flattened in sequence order.

    Sequence ``q`` contributes ``query_lens[q]`` new tokens at positions ``context_lens[q] .. context_lens[q] +
    query_lens[q] - 1`` (prefill: context 0 or the cached prefix; decode: query length 1).

    Args:
        context_lens: (num_seqs,) int, tokens already in the cache per sequence.
        query_lens: (num_seqs,) int, new tokens per sequence.
    Returns:
        (positions, seq_indices): both (sum(query_lens),) int64.
    Raises:
        ValueError: shapes differ or a length is negative.
    """
    if context_lens.shape != query_lens.shape or context_lens.ndim != 1:
        raise ValueError(f"context_lens {tuple(context_lens.shape)} and query_lens {tuple(query_lens.shape)} must "
                         f"be 1-D of equal length")
    if bool((context_lens < 0).any()) or bool((query_lens < 0).any()):
        raise ValueError("lengths must be >= 0")
    query_lens = query_lens.long()
    seq_indices = torch.repeat_interleave(torch.arange(len(query_lens), device=query_lens.device), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens  # first flat index of each sequence
    offsets = torch.arange(seq_indices.numel(), device=query_lens.device) - starts[seq_indices]
    return context_lens.long()[seq_indices] + offsets, seq_indices


def compute_slot_mapping(positions: torch.Tensor, seq_indices: torch.Tensor, block_tables: torch.Tensor,
                         block_size: int, *, validate: bool = True) -> torch.Tensor:
    """Cache slot of every token: ``block_tables[seq, pos // block_size] * block_size + pos % block_size``.

    Args:
        positions: (T,) int token positions; a negative position marks padding and maps to slot -1.
        seq_indices: (T,) int row of ``block_tables`` that owns each token.
        block_tables: (num_seqs, max_blocks) int physical block ids; unused entries may be -1.
        block_size: tokens per block (page size), >= 1.
        validate: check that every real token's block exists (one device sync; turn off in a captured graph).
    Returns:
        (T,) int64 slots.
    Raises:
        ValueError: shape mismatch, block_size < 1, or (validate) a position past the sequence's block table or
            pointing at a -1 entry.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1; got {block_size!r}")
    if positions.shape != seq_indices.shape or positions.ndim != 1:
        raise ValueError(f"positions {tuple(positions.shape)} and seq_indices {tuple(seq_indices.shape)} must be "
                         f"1-D of equal length")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be (num_seqs, max_blocks); got {tuple(block_tables.shape)}")
    positions = positions.long()
    real = positions >= 0
    safe = positions.clamp_min(0)
    logical = safe // block_size
    if validate and positions.numel():
        if bool((logical[real] >= block_tables.shape[1]).any()):
            raise ValueError(f"a position needs block {int(logical[real].max())} but block_tables has "
                             f"{block_tables.shape[1]} columns")
    blocks = block_tables.long()[seq_indices.long(), logical.clamp_max(max(block_tables.shape[1] - 1, 0))]
    if validate and positions.numel() and bool((blocks[real] < 0).any()):
        raise ValueError("a token maps to an unallocated block (-1 in block_tables)")
    slots = blocks * block_size + safe % block_size
    return torch.where(real, slots, torch.full_like(slots, -1))


def store_kv_cache_reference(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                             v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    """Write key[t] (and value[t]) into slot slot_mapping[t] of the caches, casting to the cache dtype."""
    keep = slot_mapping >= 0
    # On the CPU the usual case, no padding slot, skips the masked copy of the rows (a GPU would sync for it)
    every = slot_mapping.device.type == "cpu" and bool(keep.all())
    slots = slot_mapping.long() if every else slot_mapping[keep].long()
    for rows, cache in ((key, k_cache), (value, v_cache)):
        if rows is None:
            continue
        # index_copy_ has no fp8 kernel on the CPU: copy the bits, identical for every dtype, as words
        kept = rows if every else rows[keep]
        flat, new = _as_words(cache.view(-1, *cache.shape[2:]), kept.to(cache.dtype).contiguous())
        flat.index_copy_(0, slots, new)


def _as_words(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors' bits viewed as the widest integer (8, 4, 2 or 1 bytes) that divides every one's rows and storage
    offset: the CPU's ``index_copy_`` moves one element at a time, so a 576-float cache row goes 8-10x faster as 288
    int64 than as 2,304 bytes (2,048 rows: 0.4 against 3.7 ms on 2 Zen 3 cores)."""
    raw = [t.view(torch.uint8) for t in tensors]
    for dtype in (torch.int64, torch.int32, torch.int16):
        if all(r.shape[-1] % dtype.itemsize == 0 and r.storage_offset() % dtype.itemsize == 0 for r in raw):
            return [r.view(dtype) for r in raw]
    return raw


# Bound on the first kernel build (triton is imported lazily); kernels look names up in module globals.
tl = triton = None


@lazy_triton_kernel
def _kernel():
    global tl, triton  # kernels resolve names through module globals (closures are not seen)
    import triton
    import triton.language as tl

    @triton.jit
    def store_kv_kernel(
        key_ptr,  # (T, WK) int32 words of the new keys; row stride stride_key
        value_ptr,  # (T, WV) int32 words of the new values (read only when HAS_VALUE)
        k_cache_ptr,  # (num_slots, WK) int32 words of the key cache, contiguous
        v_cache_ptr,  # (num_slots, WV) int32 words of the value cache, contiguous
        slot_ptr,  # (T,) slot per token, -1 = padding
        stride_key,
        stride_value,
        WK,  # words per key row: H * D * itemsize / 4
        WV,
        HAS_VALUE: tl.constexpr,
        BLOCK_K: tl.constexpr,  # next power of two >= WK
        BLOCK_V: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # A padding token (slot -1) copies zero words.
        num_k = tl.where(slot >= 0, WK, 0)
        k = tl.arange(0, BLOCK_K)
        words = tl.load(key_ptr + t * stride_key + k, mask=k < num_k)
        tl.store(k_cache_ptr + slot * WK + k, words, mask=k < num_k)
        if HAS_VALUE:
            num_v = tl.where(slot >= 0, WV, 0)
            v = tl.arange(0, BLOCK_V)
            words = tl.load(value_ptr + t * stride_value + v, mask=v < num_v)
            tl.store(v_cache_ptr + slot * WV + v, words, mask=v < num_v)

    return store_kv_kernel


def _words(rows: torch.Tensor) -> torch.Tensor:
    """(T, H, D) with contiguous (H, D) rows -> (T, H*D*itemsize/4) int32 view."""
    return rows.flatten(1).view(torch.int32)


def store_kv_cache_triton(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                          v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    kw = _words(key)
    kc = k_cache.view(-1, *k_cache.shape[2:]).flatten(1).view(torch.int32)
    vw = _words(value) if value is not None else kw
    vc = v_cache.view(-1, *v_cache.shape[2:]).flatten(1).view(torch.int32) if value is not None else kc
    launch(_kernel(), (num_tokens,),
        kw, vw, kc, vc, slot_mapping, kw.stride(0), vw.stride(0), kw.shape[1], vw.shape[1],
        HAS_VALUE=value is not None, BLOCK_K=1 << max(kw.shape[1] - 1, 0).bit_length(),
        BLOCK_V=1 << max(vw.shape[1] - 1, 0).bit_length(), num_warps=4,
    )


def _row_refusal(name: str, rows: torch.Tensor | None, cache: torch.Tensor | None) -> str | None:
    if rows is None:
        return None
    if rows.dtype != cache.dtype:
        return (f"{name} dtype {str(rows.dtype).removeprefix('torch.')} differs from the cache's "
                f"{str(cache.dtype).removeprefix('torch.')} (the Triton store copies bits; cast first)")
    row_bytes = rows.shape[1] * rows.shape[2] * rows.element_size()
    if row_bytes % _WORD:
        return (f"misaligned: a {name} row of {rows.shape[1]}x{rows.shape[2]} "
                f"{str(rows.dtype).removeprefix('torch.')} is {row_bytes} bytes, not a multiple of {_WORD} (the "
                f"Triton store copies 32-bit words)")
    if rows.stride(2) != 1 or rows.stride(1) != rows.shape[2]:
        return f"{name} rows are not contiguous (stride {tuple(rows.stride())}); each (H, D) row must be"
    if rows.data_ptr() % _WORD or (rows.stride(0) * rows.element_size()) % _WORD:
        return f"misaligned: {name} rows do not start on {_WORD}-byte boundaries"
    if row_bytes > 65536:
        return f"{name} row of {row_bytes} bytes exceeds the 65536-byte one-program-per-token limit"
    return None


def _triton_supports(key, value, k_cache, v_cache, slot_mapping) -> str | None:
    return first_refusal(
        triton_refusal(key, value, k_cache, v_cache, slot_mapping),
        contiguous_refusal("k_cache", k_cache),
        contiguous_refusal("v_cache", v_cache),
        _row_refusal("key", key, k_cache),
        _row_refusal("value", value, v_cache),
    )


def _example(device: str, dtype: torch.dtype):
    num_tokens, heads, dim, block_size = 256, 8, 128, 16
    caches = [torch.zeros(64, block_size, heads, dim, device=device, dtype=dtype) for _ in range(2)]
    key, value = (torch.randn(num_tokens, heads, dim, device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(64 * block_size, device=device)[:num_tokens]
    return (key, value, caches[0], caches[1], slots), {}


STORE_KV_CACHE = register_op(Op("store_kv_cache", "write new K/V rows into their paged-cache slots", _example))
STORE_KV_CACHE.register("triton", store_kv_cache_triton, _triton_supports,
                        description="one program per token, 32-bit word copy, slot -1 skipped")
STORE_KV_CACHE.register("torch", store_kv_cache_reference, description="index_copy_ of bytes after a dtype cast")


def _check_rows(name: str, rows: torch.Tensor, cache: torch.Tensor, num_tokens: int) -> None:
    if rows.ndim != 3 or rows.shape[0] != num_tokens:
        raise ValueError(f"{name} must be (T={num_tokens}, H, D); got {tuple(rows.shape)}")
    if cache.ndim != 4 or tuple(cache.shape[2:]) != tuple(rows.shape[1:]):
        raise ValueError(f"{name} cache must be (num_blocks, block_size, {rows.shape[1]}, {rows.shape[2]}); got "
                         f"{tuple(cache.shape)}")


def store_kv_cache(key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor | None, slot_mapping: torch.Tensor, *, site: str | None = None,
                   strict: bool | None = None) -> None:
    """Store new keys (and values) into a paged cache, in place.

    Args:
        key: (T, H, D) new keys; value: (T, H, Dv) or None (MLA keeps one latent cache).
        k_cache: (num_blocks, block_size, H, D); v_cache: (num_blocks, block_size, H, Dv) or None with value.
        slot_mapping: (T,) int32/int64 slots from :func:`compute_slot_mapping`; -1 skips the token.
        site, strict: see :mod:`metainfer_gen.kernels.registry`.
    Raises:
        ValueError: shapes inconsistent, value given without v_cache (or the reverse), slots not 1-D int.
    Exact: both paths copy (the reference casts to the cache dtype; the Triton path requires equal dtypes).
    """
    if slot_mapping.ndim != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be 1-D int32/int64; got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    _check_rows("key", key, k_cache, slot_mapping.shape[0])
    if (value is None) != (v_cache is None):
        raise ValueError("give value and v_cache together, or neither")
    if value is not None:
        _check_rows("value", value, v_cache, slot_mapping.shape[0])
    STORE_KV_CACHE.dispatch(key, value, k_cache, v_cache, slot_mapping, site=site, strict=strict, stacklevel=2)
