"""The model families the engine knows, by transformers ``model_type``: what each runs, or why it cannot yet.

One table, read by the loader (which types load), the model (which attention class and indexer rope), ``doctor``
(the attention path of every family) and the audit (op :data:`AUDIT_OP`: the loaded model's path). Plain Python,
no torch, so the CLI can list it without importing the model code.

Sources: transformers 5.24 ``modeling_deepseek_v3.py``, ``modeling_deepseek_v32.py``, ``modeling_glm_moe_dsa.py``
and ``modeling_deepseek_v4.py`` (the correctness references).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        not_yet: engine features the family cannot use yet ("tensor_parallel", "fp8"), each with why
            (:func:`check_engine_settings` refuses settings that need them).
        refuses: engine features the family turns off instead of failing, each with why: "prefix_caching" (no
            prefix is registered) and "compiled_decode" (decode steps run eager: no static buffers, compiled graph
            or CUDA graphs). The model class reads its reasons from here
            (:mod:`~metainfer_gen.llm.model_refusals`); the audit and ``doctor`` print them.
        no_fp8_layers: why the model holds no FP8 weights (None: its linear layers take them): its FP8 checkpoints
            are then dequantised at load on every device (:func:`~metainfer_gen.llm.fp8.choose_weight_format`'s
            ``model_refusal``; the loader and ``doctor --model`` read it).
    """

    model_type: str
    attention: str
    sparse: bool = False
    indexer_rope_interleaved: bool = False
    missing: str | None = None
    not_yet: dict[str, str] = field(default_factory=dict)
    refuses: dict[str, str] = field(default_factory=dict)
    no_fp8_layers: str | None = None

    @property
    def supported(self) -> bool:
        return self.missing is None


_V4_ATTENTION = ("sliding-window K=V rows + compressed entries (CSA: the indexer's top-k of the 4x entries, HCA: "
                 "all 128x entries), per sequence: entries in the paged pool, window rows and compressor buffers in a "
                 "per-sequence table")
# What the engine does not do for V4 yet; settings that need it are refused (check_engine_settings).
_V4_NOT_YET = {"fp8": "its layers have no FP8 weights or FP8 KV cache yet; an FP8 checkpoint loads, dequantised"}
_V4_NO_FP8 = "deepseek_v4 has no FP8 layers yet: its experts and grouped output projection multiply in plain torch"
_V4_REFUSES = {"prefix_caching": "deepseek_v4: compressed entries and compressor buffers span block boundaries, so a "
                                 "cached block is not reusable alone yet",
               "compiled_decode": "deepseek_v4: its attention gathers per sequence and its compressors keep "
                                  "per-sequence buffers, not traced into a static graph yet"}

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (
    ModelFamily("deepseek_v3", "MLA over the paged latent cache (absorbed decode, cheaper-form prefill)"),
    ModelFamily("deepseek_v32", "MLA + DSA: per-layer indexer (half-split rope), top-k latent rows, absorbed "
                                "sparse MLA", sparse=True),
    ModelFamily("glm_moe_dsa", "MLA + DSA: indexer (interleaved rope) on indexer_types 'full' layers, 'shared' "
                               "layers reuse the previous full layer's top-k; absorbed sparse MLA", sparse=True,
                indexer_rope_interleaved=True),
    ModelFamily("deepseek_v4", _V4_ATTENTION, not_yet=_V4_NOT_YET, refuses=_V4_REFUSES, no_fp8_layers=_V4_NO_FP8),
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


def check_engine_settings(config, *, tensor_parallel_size: int = 1, quantization: str | None = None,
                          kv_cache_dtype: str = "auto") -> None:
    """Refuse engine settings a loaded ``config``'s family cannot use yet (before any process group or weight).

    Raises:
        ValueError: tensor parallelism, ``quantization="fp8"`` or an FP8 KV cache for a family whose ``not_yet``
            names them (an FP8 checkpoint is not refused here: the loader dequantises it where the model holds no
            FP8 weights); a DeepSeek-V4 ``tensor_parallel_size`` that does not divide its heads, output groups or
            shared-expert columns (:func:`~metainfer_gen.llm.models.v4_tensor_parallel.check_v4_tensor_parallel`)
            or an ``expert_dtype`` it cannot read
            (:func:`~metainfer_gen.llm.models.deepseek_v4_fp8.check_v4_quantization`). The message
            says why and what to set instead.
    """
    family = FAMILIES[config.model_type]
    name = config.model_type
    if tensor_parallel_size > 1 and "tensor_parallel" in family.not_yet:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: not yet for {name} "
                         f"({family.not_yet['tensor_parallel']}); use tensor_parallel_size=1")
    if name == "deepseek_v4":
        from metainfer_gen.llm.models.deepseek_v4_fp8 import check_v4_quantization
        from metainfer_gen.llm.models.v4_tensor_parallel import check_v4_tensor_parallel

        check_v4_tensor_parallel(config, tensor_parallel_size)
        check_v4_quantization(config)
    if "fp8" in family.not_yet:
        asked = {"quantization='fp8'": quantization == "fp8", "kv_cache_dtype='fp8'": kv_cache_dtype == "fp8"}
        for what, used in asked.items():
            if used:
                raise ValueError(f"{what}: not yet for {name} ({family.not_yet['fp8']}); use quantization=None "
                                 f"and kv_cache_dtype='auto'")


def attention_path(config) -> str:
    """The attention path of a loaded ``config`` as the audit names it (op :data:`AUDIT_OP`, site
    :data:`AUDIT_SITE`, recorded by every model forward): the family's path, plus the count of shared-top-k
    layers where ``indexer_types`` has any."""
    path = f"{config.model_type}: {FAMILIES[config.model_type].attention}"
    shared = sum(t == "shared" for t in (getattr(config, "indexer_types", None) or ()))
    return path + (f" ({shared} of {config.num_hidden_layers} layers share top-k)" if shared else "")
