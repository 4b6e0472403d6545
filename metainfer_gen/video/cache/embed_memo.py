"""Condition-embedder memo: reuse the embedder's exact outputs within a pipeline call (a lossless accelerator).

Wan's ``WanTimeTextImageEmbedding`` (diffusers ``transformer_wan.py``) runs on every transformer call: it embeds the
timestep (per token for Wan 2.2 TI2V) and projects the prompt embedding. Within one pipeline call the prompt
embedding of a CFG branch is the same tensor at every step, and both branches of a step share the timestep, so
all but one projection per branch and one timestep embedding per step repeat work whose result is known. The hook
looks each part up by value first (``torch.equal`` against the inputs it was computed from); on a miss of the
timestep it calls the embedder's own forward (diffusers', or the fused one of
:mod:`metainfer_gen.video.fuse.wan_embedder` when the kernels are fused), and on a miss of the prompt alone it runs
the embedder's ``text_embedder`` as that forward does. Outputs are bit-identical to the model without the memo.

It is independent of any step cache: it composes with ours and with the diffusers and cache-dit caches (they hook
the transformer and its blocks; this hooks the condition embedder, which runs on every call whatever they skip).
Everything is forgotten when the state resets (``_is_stateful``: diffusers' ``maybe_free_model_hooks`` resets it at
the end of every pipeline call, and our pipelines reset it after each call, failed ones included), so weights
changed between calls (a LoRA loaded) are never served stale. On the embedded model it took the embedder from 0.15
to 0.10 s per 50-step guided clip (2 threads; the rest is one timestep embedding per step, which
``timestep_embedding`` shrinks in turn).

    from metainfer_gen.video.cache.embed_memo import apply_embed_memo, remove_embed_memo

    memo = apply_embed_memo(pipe.transformer)   # after fuse_kernels, if used
    ...                                         # calls; memo.num_hits counts the parts served from the memo
    remove_embed_memo(pipe.transformer)
"""

from __future__ import annotations

import inspect

import torch
from diffusers.hooks.hooks import HookRegistry, ModelHook

from metainfer_gen.video.fuse.wan_embedder import WAN_EMBEDDER_ARGS, WAN_EMBEDDER_PARTS

EMBED_MEMO_HOOK = "metainfer_embed_memo"
_MAX_ENTRIES = 4  # prompt embeddings kept per call (two CFG branches, or a batch split in a few)


class EmbedMemoHook(ModelHook):
    """Wraps ``WanTimeTextImageEmbedding.forward`` with value-keyed reuse of its timestep and prompt parts.

    ``num_hits`` counts the parts (timestep embeddings, prompt projections) served from the memo since the hook
    was applied; ``reset_state`` forgets the inputs and outputs, not the count.
    """

    _is_stateful = True  # reset by diffusers' reset_stateful_hooks at the end of every pipeline call

    def __init__(self) -> None:
        super().__init__()
        self.time: tuple[torch.Tensor, int | None, torch.dtype, tuple] | None = None
        self.text: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_hits = 0

    def reset_state(self, module):
        """Forget every input and output (the memo is per pipeline call)."""
        self.time, self.text = None, []
        return module

    def new_forward(self, module, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                    timestep_seq_len=None):
        if self.time is not None and self.time[1] == timestep_seq_len and self.time[2] == encoder_hidden_states.dtype \
                and self.time[0].shape == timestep.shape and torch.equal(self.time[0], timestep):
            temb, timestep_proj = self.time[3]
            self.num_hits += 1
            text = self._text(module, encoder_hidden_states)
        else:
            temb, timestep_proj, text, _ = self.fn_ref.original_forward(timestep, encoder_hidden_states, None,
                                                                        timestep_seq_len)
            self.time = (timestep.clone(), timestep_seq_len, encoder_hidden_states.dtype, (temb, timestep_proj))
            self._remember_text(encoder_hidden_states, text)
        if encoder_hidden_states_image is not None:
            encoder_hidden_states_image = module.image_embedder(encoder_hidden_states_image)
        return temb, timestep_proj, text, encoder_hidden_states_image

    def _text(self, module, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        projected = self._lookup(encoder_hidden_states)
        if projected is not None:
            self.num_hits += 1
            return projected
        projected = module.text_embedder(encoder_hidden_states)
        self._remember_text(encoder_hidden_states, projected)
        return projected

    def _lookup(self, source: torch.Tensor) -> torch.Tensor | None:
        for known, projected in self.text:
            if known.shape == source.shape and known.dtype == source.dtype and torch.equal(known, source):
                return projected
        return None

    def _remember_text(self, source: torch.Tensor, projected: torch.Tensor) -> None:
        if self._lookup(source) is None:
            self.text = [*self.text[-(_MAX_ENTRIES - 1):], (source.clone(), projected)]


def embed_memo_refusal(transformer: torch.nn.Module) -> str | None:
    """Why :func:`apply_embed_memo` cannot serve ``transformer`` (None when it can)."""
    embedder = getattr(transformer, "condition_embedder", None)
    if embedder is None:
        return f"{type(transformer).__name__} has no condition_embedder (the memo serves Wan transformers)"
    missing = [name for name in WAN_EMBEDDER_PARTS if not hasattr(embedder, name)]
    if missing:
        return f"its condition_embedder {type(embedder).__name__} has no {missing}: not Wan's"
    params = list(inspect.signature(type(embedder).forward).parameters)[1:]
    if params != WAN_EMBEDDER_ARGS:
        return f"its condition_embedder takes {params}, expected {WAN_EMBEDDER_ARGS} (diffusers changed it)"
    return None


def apply_embed_memo(transformer: torch.nn.Module) -> EmbedMemoHook:
    """Put :class:`EmbedMemoHook` on ``transformer.condition_embedder`` (a diffusers ``WanTransformer3DModel``).

    Apply it after ``fuse_kernels`` (which refuses modules that already carry hooks); a step cache or diffusers
    cache may come before or after. Memory: the last timestep and up to four prompt embeddings with their outputs.

    Returns:
        The hook (``num_hits`` counts the reused parts).
    Raises:
        ValueError: the memo is already applied, or the transformer has no Wan condition embedder (the reason).
    Example::

        memo = apply_embed_memo(pipe.transformer)
        pipe("a red circle moving right", num_inference_steps=50)
        print(memo.num_hits)   # with CFG: the second branch's timestep and prompt parts of each step
        remove_embed_memo(pipe.transformer)
    """
    if get_embed_memo(transformer) is not None:
        raise ValueError("the embed memo is already applied to this transformer; call remove_embed_memo first")
    refusal = embed_memo_refusal(transformer)
    if refusal:
        raise ValueError(f"cannot apply the embed memo: {refusal}")
    hook = EmbedMemoHook()
    HookRegistry.check_if_exists_or_initialize(transformer.condition_embedder).register_hook(hook, EMBED_MEMO_HOOK)
    return hook


def remove_embed_memo(transformer: torch.nn.Module) -> None:
    """Remove the memo's hook; the embedder then computes every call again.

    Raises:
        ValueError: the memo is not applied to ``transformer``.
    """
    if get_embed_memo(transformer) is None:
        raise ValueError("the embed memo is not applied to this transformer")
    HookRegistry.check_if_exists_or_initialize(transformer.condition_embedder).remove_hook(EMBED_MEMO_HOOK,
                                                                                          recurse=False)


def get_embed_memo(transformer: torch.nn.Module) -> EmbedMemoHook | None:
    """The memo's hook on ``transformer``, or None when it is not applied."""
    registry = getattr(getattr(transformer, "condition_embedder", None), "_diffusers_hook", None)
    return None if registry is None else registry.get_hook(EMBED_MEMO_HOOK)


def reset_embed_memo(transformer: torch.nn.Module) -> None:
    """Forget the memo's entries (end of a pipeline call); nothing when the memo is not applied."""
    hook = get_embed_memo(transformer)
    if hook is not None:
        hook.reset_state(transformer.condition_embedder)
