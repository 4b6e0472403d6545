"""The model families the engine knows, by transformers ``model_type``: what each runs, or why it cannot yet.

One table, read by the loader (which types load), the model (which attention class and indexer rope), ``doctor``
(the attention path of every family) and the audit (op :data:`AUDIT_OP`: the loaded model's path). Plain Python,
no torch, so the CLI can list it without importing the model code.

Sources: transformers 5.24 ``modeling_deepseek_v3.py``, ``modeling_deepseek_v32.py``, ``modeling_glm_moe_dsa.py``
(the correctness references) and ``modeling_deepseek_v4.py`` (what the unsupported family needs).
"""

from __future__ import annotations

from dataclasses import dataclass

AUDIT_OP = "llm_attention"
AUDIT_SITE = "llm.model"


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """How the engine runs one ``model_type``.

    Attributes:
        model_type: transformers' name (``config.model_type``).
        attention: the attention path, as the audit and ``doctor`` print it.
        sparse: layers select their keys with a DSA lightning indexer.
        indexer_rope_interleaved: the indexer rotates its rope dims in interleaved pairs (GLM-5) rather than
            half-split (DeepSeek-V3.2); MLA's own rope follows ``config.rope_interleave`` in both.
        missing: None when the engine runs the family; else what it lacks (loading raises with this text).
    """

    model_type: str
    attention: str
    sparse: bool = False
    indexer_rope_interleaved: bool = False
    missing: str | None = None

    @property
    def supported(self) -> bool:
        return self.missing is None


_V4_MISSING = (
    "paged caches for its attention state (the 128-token sliding window, the 4x-compressed CSA entries with their "
    "indexer keys, the 128x-compressed HCA entries and the compressor buffers between chunks, which transformers "
    "keeps in DeepseekV4CSACache / DeepseekV4HCACache), batched steps, tensor parallelism, FP8 weights and the "
    "streamed loader for its layout; its layers (compressed sparse and heavily compressed attention, partial rotary, "
    "the grouped output projection o_lora_rank / o_groups, hyper-connections, hash-routed experts, swiglu_limit) "
    "run only in the one-sequence reference path metainfer_gen/llm/models/deepseek_v4.py")

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (
    ModelFamily("deepseek_v3", "MLA over the paged latent cache (absorbed decode, cheaper-form prefill)"),
    ModelFamily("deepseek_v32", "MLA + DSA: per-layer indexer (half-split rope), top-k latent rows, absorbed "
                                "sparse MLA", sparse=True),
    ModelFamily("glm_moe_dsa", "MLA + DSA: indexer (interleaved rope) on indexer_types 'full' layers, 'shared' "
                               "layers reuse the previous full layer's top-k; absorbed sparse MLA", sparse=True,
                indexer_rope_interleaved=True),
    ModelFamily("deepseek_v4", "not supported", missing=_V4_MISSING),
)}


def family_of(model_type: str) -> ModelFamily:
    """The family of ``model_type``.

    Raises:
        ValueError: a type the engine does not know, or one it knows but cannot run yet (the message names what
            is missing).
    """
    family = FAMILIES.get(model_type)
    supported = tuple(t for t, f in FAMILIES.items() if f.supported)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported by the engine; supported: {supported}")
    if not family.supported:
        raise ValueError(f"model_type {model_type!r} is recognised but the engine cannot run it yet: it lacks "
                         f"{family.missing}. Supported: {supported}")
    return family


def attention_path(config) -> str:
    """The attention path of a loaded ``config`` as the audit names it (op :data:`AUDIT_OP`, site
    :data:`AUDIT_SITE`, recorded by every model forward): the family's path, plus the count of shared-top-k
    layers where ``indexer_types`` has any."""
    path = f"{config.model_type}: {FAMILIES[config.model_type].attention}"
    shared = sum(t == "shared" for t in (getattr(config, "indexer_types", None) or ()))
    return path + (f" ({shared} of {config.num_hidden_layers} layers share top-k)" if shared else "")
