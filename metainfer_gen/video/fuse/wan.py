"""Fused forwards for diffusers' Wan transformer: blocks (adaLN modulate, gated residuals) and attention (q/k
RMSNorm, rotary embedding), installed as diffusers ``ModelHook``\\ s by :func:`metainfer_gen.video.fuse.fuse_kernels`.

Block contract (diffusers 0.42 ``WanTransformerBlock.forward(hidden_states, encoder_hidden_states, temb,
rotary_emb)``): ``hidden_states`` (B, S, N) in the model dtype; ``temb`` (B, 6, N) (Wan 2.1 / 2.2 14B) or (B, S, 6,
N) (Wan 2.2 TI2V), added in float32 to ``scale_shift_table`` (1, 6, N) and split into shift/scale/gate for the
self-attention and feed-forward branches; ``norm1``/``norm3`` are ``FP32LayerNorm`` without affine; the
cross-attention branch (``norm2`` with affine, plain residual) is left as it is.

Attention contract (``WanAttention`` with ``WanAttnProcessor``): projections, then ``norm_q``/``norm_k``
(``torch.nn.RMSNorm`` over all heads), heads split to (B, S, H, D), interleaved rotary embedding from the
``(freqs_cos, freqs_sin)`` pair of shape (1, S, 1, D) (values repeated per pair), attention through diffusers'
``dispatch_attention_fn`` with the processor's backend. The fused forward reproduces ``WanAttnProcessor.__call__``
step by step and only swaps the norm and rotary steps; if the module's processor is replaced after fusing (another
backend, a LoRA processor), it falls back to the module's own forward and says so in the audit.

Source followed: diffusers ``models/transformers/transformer_wan.py`` at 0.42.1.
"""

from __future__ import annotations

import functools
import inspect

import torch

from metainfer_gen.kernels.adaln import adaln_modulate, gated_residual
from metainfer_gen.kernels.audit_log import Refusal, record
from metainfer_gen.video.fuse.core import FUSE_HOOK, FuseKernelsConfig
from metainfer_gen.kernels.norm import rms_norm
from metainfer_gen.kernels.rotary import rope

__all__ = ["WAN_BLOCK_ARGS", "FusedWanAttentionHook", "FusedWanBlockHook", "fuse_wan_attention", "fuse_wan_block"]

# The leading parameters of diffusers' WanTransformerBlock.forward (also read by the step cache's gated residuals).
WAN_BLOCK_ARGS = ["hidden_states", "encoder_hidden_states", "temb", "rotary_emb"]


@functools.cache
def _model_hook_base():
    """The base of every fuse hook: a stateless diffusers ``ModelHook`` holding its :class:`FuseKernelsConfig`
    (one class, built on the first fuse: ``kernels.fuse`` loads the fuser modules lazily)."""
    from diffusers.hooks import ModelHook

    class FuseHook(ModelHook):
        _is_stateful = False

        def __init__(self, config: FuseKernelsConfig):
            super().__init__()
            self.config = config

    return FuseHook


class FusedWanBlockHook(_model_hook_base()):
    """Replaces ``WanTransformerBlock.forward``: adaLN modulate and gated residuals through the kernel registry."""

    def new_forward(self, block, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    temb: torch.Tensor, rotary_emb, **kwargs) -> torch.Tensor:
        strict = self.config.strict
        if temb.ndim == 4:  # (B, S, 6, N): one timestep per token
            mods = [m.squeeze(2) for m in (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
        else:  # (B, 6, N)
            mods = (block.scale_shift_table + temb.float()).chunk(6, dim=1)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mods

        # 1. self-attention
        norm = adaln_modulate(hidden_states, scale_msa, shift_msa, block.norm1.eps,
                              site="WanTransformerBlock.norm1", strict=strict)
        attn_output = block.attn1(norm, None, None, rotary_emb)
        hidden_states = gated_residual(hidden_states, attn_output, gate_msa, site="WanTransformerBlock.attn1",
                                       strict=strict)
        # 2. cross-attention (affine norm, ungated residual: unchanged)
        norm = block.norm2(hidden_states.float()).type_as(hidden_states)
        hidden_states = hidden_states + block.attn2(norm, encoder_hidden_states, None, None)
        # 3. feed-forward
        norm = adaln_modulate(hidden_states, c_scale_msa, c_shift_msa, block.norm3.eps,
                              site="WanTransformerBlock.norm3", strict=strict)
        ff_output = block.ffn(norm)
        return gated_residual(hidden_states, ff_output, c_gate_msa, site="WanTransformerBlock.ffn", strict=strict)


# One entry: the rotary pair of the current forward (every block's attention sees the same tuple object). Holding a
# reference keeps the id from being reused, so identity is a safe key.
_rope_cache: list = [None, None]


def _half_tables(rotary_emb) -> tuple[torch.Tensor, torch.Tensor]:
    freqs_cos, freqs_sin = rotary_emb
    if _rope_cache[0] is not None and _rope_cache[0][0] is freqs_cos and _rope_cache[0][1] is freqs_sin:
        return _rope_cache[1]
    # (1, S, 1, D) repeated per pair -> (S, D/2); sin from the odd slots, as WanAttnProcessor reads it.
    tables = (freqs_cos[0, :, 0, 0::2].float().contiguous(), freqs_sin[0, :, 0, 1::2].float().contiguous())
    _rope_cache[0], _rope_cache[1] = (freqs_cos, freqs_sin), tables
    return tables


class FusedWanAttentionHook(_model_hook_base()):
    """Replaces ``WanAttention.forward`` while its processor is a plain ``WanAttnProcessor``."""

    def new_forward(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, rotary_emb=None, **kwargs) -> torch.Tensor:
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        processor = attn.processor
        if type(processor) is not WanAttnProcessor or kwargs:
            why = (f"processor is {type(processor).__name__}, not WanAttnProcessor" if not kwargs
                   else f"extra arguments {sorted(kwargs)}")
            record("wan_attention", "WanAttention", "original", (Refusal("fused", why),))
            return self.fn_ref.original_forward(hidden_states, encoder_hidden_states, attention_mask, rotary_emb,
                                                **kwargs)
        return self._fused(attn, processor, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

    def _norm(self, module, x: torch.Tensor, site: str) -> torch.Tensor:
        if not self.config.qk_norm:
            return module(x)
        return rms_norm(x, module.weight, module.eps, site=site, strict=self.config.strict)

    def _rotate(self, x: torch.Tensor, rotary_emb, site: str) -> torch.Tensor:
        if not self.config.rope:
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # WanAttnProcessor.apply_rotary_emb, verbatim
            cos, sin = rotary_emb[0][..., 0::2], rotary_emb[1][..., 1::2]
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * cos - x2 * sin
            out[..., 1::2] = x1 * sin + x2 * cos
            return out.type_as(x)
        cos, sin = _half_tables(rotary_emb)
        return rope(x, cos, sin, interleaved=True, site=site, strict=self.config.strict)

    def _fused(self, attn, processor, hidden_states, encoder_hidden_states, attention_mask, rotary_emb):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_wan import (_get_added_kv_projections,
                                                                   _get_qkv_projections)

        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            # 512 is the context length of the text encoder, hard-coded in WanAttnProcessor too
            image_context_length = encoder_hidden_states.shape[1] - 512
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        # Self- and cross-attention (attn1, attn2) are separate call sites in the audit: their keys differ in length.
        site = "WanAttention(self)" if encoder_hidden_states is None else "WanAttention(cross)"
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)  # (B, S, H*D)
        query = self._norm(attn.norm_q, query, f"{site}.norm_q")
        key = self._norm(attn.norm_k, key, f"{site}.norm_k")
        query = query.unflatten(2, (attn.heads, -1))  # (B, S, H, D)
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = self._rotate(query, rotary_emb, f"{site}.rope_q")
            key = self._rotate(key, rotary_emb, f"{site}.rope_k")

        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = self._norm(attn.norm_added_k, key_img, f"{site}.norm_added_k")
            key_img = key_img.unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            hidden_states_img = dispatch_attention_fn(query, key_img, value_img, attn_mask=None, dropout_p=0.0,
                                                      is_causal=False, backend=processor._attention_backend,
                                                      parallel_config=None)
            hidden_states_img = hidden_states_img.flatten(2, 3).type_as(query)

        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=processor._attention_backend,
            parallel_config=(processor._parallel_config if encoder_hidden_states is None else None),
        )
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


def _no_affine(norm) -> bool:
    return getattr(norm, "weight", None) is None and getattr(norm, "bias", None) is None and hasattr(norm, "eps")


def _register(module, hook) -> None:
    from diffusers.hooks import HookRegistry

    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, FUSE_HOOK)


def fuse_wan_block(block, name: str, config: FuseKernelsConfig) -> str | None:
    """Install :class:`FusedWanBlockHook` on a ``WanTransformerBlock``, or return why not."""
    if not config.adaln:
        return "adaln disabled in FuseKernelsConfig"
    params = list(inspect.signature(type(block).forward).parameters)[1:]
    if params[:4] != WAN_BLOCK_ARGS:
        return f"forward takes {params}, expected {WAN_BLOCK_ARGS} (diffusers version changed the block)"
    if not (_no_affine(block.norm1) and _no_affine(block.norm3)):
        return "norm1/norm3 have an affine weight; the fused adaLN assumes a plain LayerNorm"
    table = getattr(block, "scale_shift_table", None)
    if table is None or table.ndim != 3 or table.shape[1] != 6:
        return "no (1, 6, N) scale_shift_table"
    _register(block, FusedWanBlockHook(config))
    return None


def fuse_wan_attention(attn, name: str, config: FuseKernelsConfig) -> str | None:
    """Install :class:`FusedWanAttentionHook` on a ``WanAttention``, or return why not."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    if not (config.qk_norm or config.rope):
        return "qk_norm and rope disabled in FuseKernelsConfig"
    if type(attn.processor) is not WanAttnProcessor:
        return f"processor is {type(attn.processor).__name__}, not WanAttnProcessor"
    norms = [attn.norm_q, attn.norm_k] + ([attn.norm_added_k] if attn.add_k_proj is not None else [])
    if not all(isinstance(n, torch.nn.RMSNorm) for n in norms):
        return f"q/k norms are {sorted({type(n).__name__ for n in norms})}, not torch.nn.RMSNorm"
    _register(attn, FusedWanAttentionHook(config))
    return None
