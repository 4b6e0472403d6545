"""Prompt-embedding cache: the text encoder runs once per distinct prompt, across calls and requests.

A diffusers Wan pipeline encodes the prompt and, with classifier-free guidance, the negative prompt on every call
(``encode_prompt`` -> ``_get_t5_prompt_embeds`` once per side). A server or a batch renders the same negative prompt
on every clip and often the same prompts again (seeds, presets, retries). This cache wraps the pipeline's
``_get_t5_prompt_embeds`` (an instance attribute over the class method, so removing it restores diffusers' own) and
keeps the last ``max_entries`` results in a bounded LRU, keyed by everything the result depends on: the texts,
``num_videos_per_prompt``, ``max_sequence_length``, the encoder's identity and the state of its weights (object id,
parameter count and in-place version counters: a LoRA or ``load_state_dict`` on the encoder changes the key, so a
stale embedding is never served), and the dtype and device asked. A hit returns a copy of the stored tensor, bit
for bit what the encoder returned for that key; so does a miss (the encoder ran).

Memory: ``max_entries`` x (batch x ``max_sequence_length`` x text width) floats (the embedded model: 16 x 64
floats, 4 KiB, per entry). Thread-safe (one lock around the table; the encoder runs outside it).

    from metainfer_gen.video.prompt_cache import apply_prompt_cache, remove_prompt_cache

    cache = apply_prompt_cache(pipe.diffusers_pipeline, max_entries=256)
    ...                       # calls; cache.num_hits / cache.num_misses count the look-ups
    remove_prompt_cache(pipe.diffusers_pipeline)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable

ENCODE_METHOD = "_get_t5_prompt_embeds"  # diffusers' per-side prompt encoder of the Wan pipelines
DEFAULT_MAX_ENTRIES = 256


class PromptEmbedCache:
    """A bounded, thread-safe LRU of prompt embeddings in front of one encode function.

    Args:
        encode: the wrapped function, ``encode(prompt=..., num_videos_per_prompt=..., max_sequence_length=...,
            device=..., dtype=...) -> Tensor`` (diffusers' ``_get_t5_prompt_embeds``).
        identity: ``() -> hashable``, the encoder's identity and weight state (part of every key).
        max_entries: most embeddings kept (>= 1); the least recently used goes first.
    Raises:
        ValueError: ``max_entries`` < 1.
    """

    def __init__(self, encode: Callable[..., Any], identity: Callable[[], Hashable],
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1; got {max_entries!r}")
        self.encode, self.identity, self.max_entries = encode, identity, max_entries
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = self.num_misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, prompt: Any, num_videos_per_prompt: int, max_sequence_length: int, device: Any,
            dtype: Any) -> Hashable:
        """Everything the embedding depends on: texts, repeats, length, encoder state, dtype, device."""
        texts = (prompt,) if isinstance(prompt, str) else tuple(prompt)
        return (texts, int(num_videos_per_prompt), int(max_sequence_length), self.identity(), str(dtype),
                str(device))

    def __call__(self, prompt: Any = None, num_videos_per_prompt: int = 1, max_sequence_length: int = 226,
                 device: Any = None, dtype: Any = None):
        """The embedding of ``prompt`` (a copy of the cached tensor, or the encoder's output on a miss)."""
        key = self.key(prompt, num_videos_per_prompt, max_sequence_length, device, dtype)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                return found.clone()
            self.num_misses += 1
        embeds = self.encode(prompt=prompt, num_videos_per_prompt=num_videos_per_prompt,
                             max_sequence_length=max_sequence_length, device=device, dtype=dtype)
        with self._lock:
            self._entries[key] = embeds.detach().clone()
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return embeds

    def clear(self) -> None:
        """Forget every embedding (the counts stay)."""
        with self._lock:
            self._entries.clear()

    def to_dict(self) -> dict[str, int]:
        """``{"entries", "max_entries", "num_hits", "num_misses"}`` (for stats and the audit)."""
        return {"entries": len(self), "max_entries": self.max_entries, "num_hits": self.num_hits,
                "num_misses": self.num_misses}


def encoder_identity(encoder: Any) -> Hashable:
    """Identity and weight state of a text encoder: object id, parameter count and the sum of the parameters'
    in-place version counters (bumped by ``copy_``, ``load_state_dict``, fusing a LoRA; adding adapters changes the
    count)."""
    params = list(encoder.parameters()) if encoder is not None else []
    return id(encoder), len(params), sum(p._version for p in params)


def prompt_cache_refusal(pipe: Any) -> str | None:
    """Why :func:`apply_prompt_cache` cannot serve the diffusers pipeline ``pipe`` (None when it can)."""
    if not callable(getattr(type(pipe), ENCODE_METHOD, None)):
        return f"{type(pipe).__name__} has no {ENCODE_METHOD} (the cache serves diffusers' Wan pipelines)"
    if getattr(pipe, "text_encoder", None) is None:
        return f"{type(pipe).__name__} has no text encoder"
    return None


def apply_prompt_cache(pipe: Any, max_entries: int = DEFAULT_MAX_ENTRIES) -> PromptEmbedCache:
    """Put a :class:`PromptEmbedCache` in front of ``pipe._get_t5_prompt_embeds`` (a diffusers Wan pipeline).

    Returns:
        The cache (``num_hits``, ``num_misses``, ``to_dict()``).
    Raises:
        ValueError: already applied, ``pipe`` is not a Wan pipeline (the reason), or a bad ``max_entries``.
    """
    if get_prompt_cache(pipe) is not None:
        raise ValueError("a prompt-embedding cache is already applied; call remove_prompt_cache first")
    refusal = prompt_cache_refusal(pipe)
    if refusal:
        raise ValueError(f"cannot apply the prompt-embedding cache: {refusal}")
    original = getattr(type(pipe), ENCODE_METHOD).__get__(pipe)
    cache = PromptEmbedCache(original, lambda: encoder_identity(pipe.text_encoder), max_entries)
    setattr(pipe, ENCODE_METHOD, cache)
    return cache


def share_prompt_cache(source: Any, target: Any) -> None:
    """Serve ``target`` (a pipeline made from ``source``'s components) from ``source``'s cache, so both tasks of
    one loaded model encode each prompt once. Nothing when ``source`` has none or ``target`` has one."""
    cache = get_prompt_cache(source)
    if cache is not None and get_prompt_cache(target) is None and prompt_cache_refusal(target) is None \
            and source.text_encoder is target.text_encoder:
        setattr(target, ENCODE_METHOD, cache)


def remove_prompt_cache(pipe: Any) -> None:
    """Take the cache off ``pipe``; diffusers' own encoder call is back. No-op when none is applied."""
    if get_prompt_cache(pipe) is not None:
        delattr(pipe, ENCODE_METHOD)


def get_prompt_cache(pipe: Any) -> PromptEmbedCache | None:
    """The cache applied to ``pipe``, or None."""
    found = pipe.__dict__.get(ENCODE_METHOD) if hasattr(pipe, "__dict__") else None
    return found if isinstance(found, PromptEmbedCache) else None
