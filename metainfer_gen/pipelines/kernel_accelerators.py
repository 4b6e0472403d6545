"""The lossless accelerators of the video pipelines that swap code into the wrapped model from outside: the fused
kernels (:mod:`metainfer_gen.video.fuse`) and the condition-embedder memo
(:mod:`metainfer_gen.video.cache.embed_memo`), kept in the right order (the memo outermost)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any


class KernelAcceleratorsMixin:
    """Methods of :class:`~metainfer_gen.pipelines.video_base.VideoPipelineBase` (needs ``transformers`` and
    ``diffusers_pipeline``)."""

    def enable_fused_kernels(self, transformer: bool = True, vae: bool = True, config: Any = None) -> None:
        """Swap the registry's kernels into the model from outside (removable; see ``video.fuse.fuse_kernels``).

        Args:
            transformer: the transformer blocks' fused adaLN, q/k norm and rotary kernels, and the condition
                embedder's per-token timestep MLP once per distinct timestep (``kernels.timestep_embedding``).
            vae: the video VAE's causal 3-D convolutions through ``kernels.conv3d`` (oneDNN on the CPU, where
                PyTorch's own size rule picks its slow path: the embedded model's decode 2.3-2.7x faster) and its
                channel norms through ``kernels.channel_rms_norm``.
            config: a ``video.fuse.FuseKernelsConfig`` choosing the ops (default: all).
        Modules that already carry the kernels (a pipeline made with ``from_pipe`` shares them) are left as they are.
        """
        from metainfer_gen.video.fuse import fuse_kernels
        from metainfer_gen.video.fuse.core import is_fused

        with self._hooks_lifted():
            for model in self._fusable(transformer, vae):
                if not is_fused(model):
                    fuse_kernels(model, config)

    def disable_fused_kernels(self) -> None:
        """Take every kernel that :meth:`enable_fused_kernels` swapped in out again."""
        from metainfer_gen.video.fuse import unfuse_kernels

        with self._hooks_lifted():
            for model in self._fusable(True, True):
                unfuse_kernels(model)

    def enable_embed_memo(self) -> None:
        """Reuse the condition embedder's exact outputs within each call (lossless; ``from_pretrained`` turns it on).

        Each step's timestep is then embedded once for both CFG branches and the second branch's prompt projected
        once per call, by value lookup, so outputs stay bit-identical (:mod:`metainfer_gen.video.cache.embed_memo`;
        about 6% of a clip with the ``fast`` step cache on the embedded model). Independent of
        :meth:`enable_step_cache`: it composes with ours and with every baseline, and with the fused kernels in
        either order. Its entries are forgotten after every call. A pipeline made with ``from_pipe`` shares it.
        Raises:
            ValueError: no transformer of this pipeline has Wan's condition embedder (with the reason).
        """
        from metainfer_gen.video.cache.embed_memo import apply_embed_memo, embed_memo_refusal, get_embed_memo

        refusals = [embed_memo_refusal(model) for model in self.transformers]
        if all(refusals):
            raise ValueError(f"cannot enable the embed memo: {refusals[0]}")
        for model, refusal in zip(self.transformers, refusals):
            if refusal is None and get_embed_memo(model) is None:
                apply_embed_memo(model)

    def disable_embed_memo(self) -> None:
        """Remove the embed memo; no-op when it is not enabled."""
        from metainfer_gen.video.cache.embed_memo import get_embed_memo, remove_embed_memo

        for model in self.transformers:
            if get_embed_memo(model) is not None:
                remove_embed_memo(model)

    @property
    def embed_memo_enabled(self) -> bool:
        """True when :meth:`enable_embed_memo` is in effect."""
        from metainfer_gen.video.cache.embed_memo import get_embed_memo

        return any(get_embed_memo(model) is not None for model in self.transformers)

    @contextmanager
    def _hooks_lifted(self):
        """The embed memo and the step cache off while kernels are (un)fused, then back, the cache first and the
        memo outermost: ``fuse_kernels`` refuses hooked modules, and a hook removed from under another would leave
        it bypassed. So the accelerators may be enabled in any order."""
        memo, cache = self.embed_memo_enabled, getattr(self, "step_cache", None)
        if memo:
            self.disable_embed_memo()
        if cache is not None:
            cache.remove(self.diffusers_pipeline)
        try:
            yield
        finally:
            if cache is not None:
                cache.apply(self.diffusers_pipeline)
            if memo:
                self.enable_embed_memo()

    @contextmanager
    def _embed_memo_call(self):
        """Around one call: the memo forgets its entries afterwards, also when the call fails."""
        try:
            yield
        finally:
            from metainfer_gen.video.cache.embed_memo import reset_embed_memo

            for model in self.transformers:
                reset_embed_memo(model)

    def _fusable(self, transformer: bool, vae: bool) -> list:
        vae_model = getattr(self.diffusers_pipeline, "vae", None)
        return (self.transformers if transformer else []) + ([vae_model] if vae and vae_model is not None else [])
