"""DeepSeek-V4, the non-paged reference path: one sequence at a time, prefill in any chunks, then decode.

The first V4 increment (``docs/llm_deepseek_v4.md``): every V4 layer type on the engine's layers, with its state
(sliding-window keys, compressor buffers, compressed entries, indexer keys) in per-sequence tensors
(:class:`~metainfer_gen.llm.layers.v4_attention.AttentionState`), token-exact with transformers; weights come from
a transformers state dict (:meth:`DeepseekV4Reference.from_hf`). The engine's V4 model, on the same modules, is
:mod:`metainfer_gen.llm.models.deepseek_v4_engine` (paged caches, batched steps).

Structure per layer (transformers ``DeepseekV4DecoderLayer``): ``hc_mult`` residual streams; the attention hyper-
connection collapses them into the attention input and merges its output back, then the MLP's does the same;
:class:`~metainfer_gen.llm.layers.hyper_connection.HyperHead` collapses them before the final norm and the head.
Source: transformers 5.24 ``modeling_deepseek_v4.py`` (the correctness reference; parameter names as there).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from metainfer_gen.llm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from metainfer_gen.llm.layers.hyper_connection import HyperConnection, HyperHead
from metainfer_gen.llm.layers.norm import RMSNorm
from metainfer_gen.llm.layers.v4_attention import AttentionState, V4Attention
from metainfer_gen.llm.layers.v4_moe import V4MoE
from metainfer_gen.llm.parallel import TensorParallel


class V4RotaryTables(nn.Module):
    """cos/sin (positions, rope_dim / 2) float32 for the "main" and "compress" rope types, from transformers'
    ``DeepseekV4RotaryEmbedding`` (so each type's theta, partial factor and scaling are its own)."""

    def __init__(self, config, max_positions: int):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

        rotary = DeepseekV4RotaryEmbedding(config)
        positions = torch.arange(max_positions)[None]
        self.tables = {}
        for kind in ("main", "compress"):
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions, kind)
            self.tables[kind] = (cos[0].contiguous(), sin[0].contiguous())


class V4DecoderLayer(nn.Module):
    """Attention and MoE between two hyper-connections; ``tp`` splits the attention heads and the experts (norms and
    hyper-connections are replicated)."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.self_attn = V4Attention(config, layer_idx, tp)
        self.mlp = V4MoE(config, layer_idx, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor,
                attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """streams (T, hc_mult, hidden) -> (T, hc_mult, hidden); ``attend`` maps the normed attention input
        (T, hidden) to the attention output (T, hidden) (this path's state, or the engine's paged caches)."""
        post, comb, h = self.attn_hc(streams)
        streams = HyperConnection.merge(post, comb, attend(self.input_layernorm(h)), streams)
        post, comb, h = self.ffn_hc(streams)
        return HyperConnection.merge(post, comb, self.mlp(self.post_attention_layernorm(h), input_ids), streams)


class V4Model(nn.Module):
    """Embedding (split by vocabulary under ``tp``), decoder layers, HyperHead and final norm (checkpoint prefix
    ``model.``)."""

    def __init__(self, config, tp: TensorParallel | None = None):
        super().__init__()
        self.hc_mult = config.hc_mult
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(V4DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class V4CausalLM(nn.Module):
    """The modules every V4 causal LM holds (checkpoint names ``model.*``, ``lm_head``) and its rope tables; the
    reference path below and the engine's model
    (:class:`~metainfer_gen.llm.models.deepseek_v4_engine.DeepseekV4ForCausalLM`) differ in their forward only.

    Args:
        config: a transformers ``DeepseekV4Config``.
        max_positions: size of the rope tables (the longest sequence it can run).
        tp: this rank's place under tensor parallelism (None: one process); what is split and what replicated:
            :mod:`metainfer_gen.llm.models.v4_tensor_parallel`.
    Raises:
        ValueError: a layer or MLP type V4 does not define (from the layers); a tensor-parallel size that does not
            divide the heads, output groups or shared-expert columns (before any layer is built).
    """

    def __init__(self, config, max_positions: int, tp: TensorParallel | None = None):
        from metainfer_gen.llm.models.v4_tensor_parallel import check_v4_tensor_parallel

        super().__init__()
        tp = tp or TensorParallel.single()
        check_v4_tensor_parallel(config, tp.size)
        self.config, self.max_positions = config, max_positions
        self.model = V4Model(config, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.rotary = V4RotaryTables(config, max_positions)


class DeepseekV4Reference(V4CausalLM):
    """DeepSeek-V4 for one sequence (see :class:`V4CausalLM` for the arguments)."""

    @classmethod
    def from_hf(cls, hf_model, max_positions: int) -> "DeepseekV4Reference":
        """Built from a transformers ``DeepseekV4ForCausalLM``'s weights (every parameter and buffer by name).

        Raises:
            RuntimeError: names that do not match (listed).
        """
        model = cls(hf_model.config, max_positions)
        missing, unexpected = model.load_state_dict(hf_model.state_dict(), strict=False)
        unexpected = [k for k in unexpected if "rotary_emb" not in k]
        if missing or unexpected:
            raise RuntimeError(f"weights do not match: missing {missing[:10]}, unexpected {unexpected[:10]}")
        return model.eval()

    def new_state(self) -> list[AttentionState]:
        """A fresh sequence: one state per layer."""
        return [AttentionState() for _ in self.model.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int, state: list[AttentionState]) -> torch.Tensor:
        """The sequence's next tokens input_ids (T,) int64 at positions ``start`` .. ``start + T - 1`` (``start``
        = tokens ``state`` has seen) -> logits (T, vocab) float32.

        Raises:
            ValueError: positions past ``max_positions``.
        """
        if start + input_ids.shape[0] > self.max_positions:
            raise ValueError(f"positions up to {start + input_ids.shape[0]} exceed max_positions="
                             f"{self.max_positions}")
        positions = torch.arange(start, start + input_ids.shape[0], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.model.hc_mult, -1).contiguous()
        for layer, layer_state in zip(self.model.layers, state):
            streams = layer(streams, input_ids, partial(layer.self_attn, positions=positions, state=layer_state,
                                                        tables=self.rotary.tables))
        return self.lm_head(self.model.norm(self.model.hc_head(streams))).float()

    def greedy(self, prompt: list[int], max_new_tokens: int, chunk: int | None = None) -> list[int]:
        """Greedy tokens after ``prompt``, its prefill split into ``chunk``-token pieces (None: one piece)."""
        state, ids = self.new_state(), list(prompt)
        step = chunk or len(ids)
        for lo in range(0, len(ids), step):
            logits = self(torch.tensor(ids[lo:lo + step]), lo, state)
        out = []
        for _ in range(max_new_tokens):
            out.append(int(logits[-1].argmax()))
            logits = self(torch.tensor(out[-1:]), len(ids) + len(out) - 1, state)
        return out
