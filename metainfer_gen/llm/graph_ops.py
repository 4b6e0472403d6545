"""The engine's data-dependent steps as opaque ops, so a compiled step stays one graph around them.

A decode step compiled with ``torch.compile`` (:mod:`metainfer_gen.llm.compiled_decode`) traces the model's dense
math (norms, projections, rotary, routing, the absorbed-MLA GEMMs) into one Inductor graph. Three steps do not
trace as they run eagerly: the paged attention (reads context lengths on the host to skip finished sequences) and
the routed experts (sorts tokens by expert and reads the per-expert counts on the host). Each is a ``torch.library``
custom op here (vLLM registers its attention and fused MoE the same way):
the graph calls it as an extern kernel with known output shapes, and inside it the eager kernel runs with its own
dispatch and audit, exactly as in an eager step.

The paged-cache write is traced (an ``index_put_`` into the cache; the padding rows of a compiled step write a sink
slot). Outside a compile every function here calls the kernel directly (no custom-op dispatch cost).

A compiled prefill step (:mod:`metainfer_gen.llm.compiled_prefill`) has a symbolic token count and per-sequence
host lists (query lengths, starts, slots) no graph may freeze, so its whole attention (with its cache write) is one
opaque op, ``metainfer::mla_store_attend``, that reads the step's ``AttentionMetadata`` from :func:`step_context`
(vLLM's forward context does the same for its attention op), and its routed experts always take the opaque op.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from metainfer_gen import kernels


@torch.library.custom_op("metainfer::paged_mla_decode", mutates_args=())
def _paged_mla_decode(q: torch.Tensor, kv_rows: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, block_size: int, value_dim: int, scale: float,
                      site: str) -> torch.Tensor:
    width = -(-int(context_lens.max()) // block_size)  # the table may be wider than the longest context
    return kernels.paged_mla_decode(q, kv_rows, block_tables[:, :width], context_lens, block_size, value_dim, scale,
                                    site=site).contiguous()  # the fake's layout (a kernel may return a view)


@_paged_mla_decode.register_fake
def _(q, kv_rows, block_tables, context_lens, block_size, value_dim, scale, site):
    return q.new_empty(q.shape[0], q.shape[1], value_dim)


@torch.library.custom_op("metainfer::moe_experts", mutates_args=())
def _moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 first_expert: int, site: str) -> torch.Tensor:
    return kernels.moe_experts(x, weights, ids, w13, w2, first_expert, site=site).contiguous()


@_moe_experts.register_fake
def _(x, weights, ids, w13, w2, first_expert, site):
    return torch.empty_like(x)


def store_latent(rows: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, site: str) -> None:
    """Write cache rows (T, 1, row) into ``kv_cache`` (num_blocks, block_size, 1, row) at ``slot_mapping`` (T,)
    int64, cast to the cache dtype (:func:`metainfer_gen.kernels.store_kv_cache`; a slot of -1 is skipped).

    Under a compile the write is traced (an in-place ``index_put_`` Inductor keeps in place) and every slot must be
    valid: the compiled decode step points its padding rows at a sink slot no sequence reads."""
    if torch.compiler.is_compiling():
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        flat.index_put_((slot_mapping,), rows.reshape(-1, flat.shape[1]).to(flat.dtype))
    else:
        kernels.store_kv_cache(rows.to(kv_cache.dtype), None, kv_cache, None, slot_mapping, site=site)


def paged_mla_decode(q: torch.Tensor, kv_rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     block_size: int, value_dim: int, scale: float, site: str) -> torch.Tensor:
    """:func:`metainfer_gen.kernels.paged_mla_decode` (same arguments and result, (B, N, r) in q.dtype); under a
    compile ``block_tables`` may be wider than the longest context (the op trims it on the host)."""
    if torch.compiler.is_compiling():
        return torch.ops.metainfer.paged_mla_decode(q, kv_rows, block_tables, context_lens, block_size, value_dim,
                                                    scale, site)
    return kernels.paged_mla_decode(q, kv_rows, block_tables, context_lens, block_size, value_dim, scale, site=site)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                first_expert: int, site: str) -> torch.Tensor:
    """:func:`metainfer_gen.kernels.moe_experts` (x (T, H) -> (T, H) in x.dtype), opaque under a compile."""
    if torch.compiler.is_compiling():
        return torch.ops.metainfer.moe_experts(x, weights, ids, w13, w2, first_expert, site)
    return kernels.moe_experts(x, weights, ids, w13, w2, first_expert, site=site)


_step = threading.local()  # the metadata and attention layers of the step a compiled prefill graph is running


@contextlib.contextmanager
def step_context(meta, layers: dict[int, torch.nn.Module]):
    """Within this block (this thread), :func:`mla_store_attend` writes and attends with ``meta`` (the step's
    :class:`~metainfer_gen.llm.attention_metadata.AttentionMetadata`) through ``layers[layer_idx]``."""
    previous = getattr(_step, "value", None)
    _step.value = (meta, layers)
    try:
        yield
    finally:
        _step.value = previous


def current_step():
    """``(meta, layers)`` of the enclosing :func:`step_context`.

    Raises:
        RuntimeError: outside a step context (a compiled prefill graph called without one).
    """
    value = getattr(_step, "value", None)
    if value is None:
        raise RuntimeError("no step context: a compiled prefill graph runs inside graph_ops.step_context(meta, "
                           "layers)")
    return value


def _store_attend(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                  layer_idx: int) -> torch.Tensor:
    meta, layers = current_step()
    layer = layers[layer_idx]
    store_latent(latent, kv_cache, meta.slot_mapping, layer.site)
    return layer.attend_dense(q_nope, q_pe, kv_cache.view(-1, kv_cache.shape[-1]), meta)


@torch.library.custom_op("metainfer::mla_store_attend", mutates_args=("kv_cache",))
def _mla_store_attend(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                      layer_idx: int, out_features: int) -> torch.Tensor:
    return _store_attend(q_nope, q_pe, latent, kv_cache, layer_idx).contiguous()


@_mla_store_attend.register_fake
def _(q_nope, q_pe, latent, kv_cache, layer_idx, out_features):
    return q_nope.new_empty(q_nope.shape[0], out_features)


def mla_store_attend(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                     layer_idx: int, out_features: int) -> torch.Tensor:
    """Layer ``layer_idx``'s cache write and MLA over the step of :func:`step_context` (its decode rows absorbed,
    its prefill rows expanded or absorbed, each as in an eager step), one opaque op under a compile (it writes
    ``kv_cache``, so the graph orders it after every earlier read and before every later one): q_nope (T, N, dn),
    q_pe (T, N, dr), latent (T, 1, r + dr) -> (T, out_features = N * dv) in q's dtype."""
    if torch.compiler.is_compiling():
        return torch.ops.metainfer.mla_store_attend(q_nope, q_pe, latent, kv_cache, layer_idx, out_features)
    return _store_attend(q_nope, q_pe, latent, kv_cache, layer_idx)
