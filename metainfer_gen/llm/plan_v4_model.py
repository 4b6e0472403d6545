"""DeepSeek-V4's weights and attention state per rank from its config alone (plain Python, no torch).

Every parameter transformers 5.24 ``DeepseekV4ForCausalLM`` builds is one :class:`V4Tensor` group
(:func:`v4_tensors`): the embedding and head, the final norm and ``DeepseekV4HyperHead``; per layer the q LoRA
(``q_a_proj``, ``q_a_norm``, ``q_b_proj``), ``kv_proj`` + ``kv_norm``, the grouped output projection (``o_a_proj``:
``num_heads * head_dim / o_groups -> o_groups * o_lora_rank`` block-diagonal, ``o_b_proj``), ``sinks``, the
compressor (``kv_proj``/``gate_proj`` 2x ``head_dim`` wide on CSA layers, ``position_bias`` (rate, width),
``kv_norm``), CSA's indexer (its own compressor at ``index_head_dim``, ``q_b_proj``, ``scorer.weights_proj``), two
``DeepseekV4HyperConnection`` per layer (``fn`` ((2 + n) n, n hidden), ``base``, ``scale`` (3,)), the two layer
norms, and the MoE (routed ``gate_up_proj``/``down_proj``, one shared ``DeepseekV4MLP`` of
``moe_intermediate_size``, the router ``weight``), plus the persistent router buffers (``tid2eid`` on
``hash_moe`` layers, ``e_score_correction_bias`` on the others). The MTP layer (``num_nextn_predict_layers``) is
not instantiated by transformers and not counted.

Tensor parallelism as the engine splits DeepSeek-V3 (:func:`metainfer_gen.llm.plan_model.weight_bytes_per_rank`):
q_b, o_a (whole groups), o_b and the sinks by heads, the shared expert by columns, embedding and head by vocabulary
rows, routed experts whole over all expert ranks. Replicated on every rank: the q_a LoRA, the single 512-wide K=V
head's ``kv_proj``, the compressors and the indexer (like MLA's latent and DSA's indexer), the hyper-connections,
norms and the router.

Storage per weight format (``WEIGHT_FORMATS``): "bf16" every weight 2 bytes; "fp8" the attention projections,
the indexer's ``q_b_proj`` and every expert in e4m3 with 128x128-block float32 scales, while the compressors' and
the indexer's ``kv_proj``/``gate_proj`` and ``weights_proj`` stay bf16 (transformers' ``_keep_in_fp32_modules``:
the V4-Flash checkpoint ships them in BF16), embedding/head/router bf16. In every format the modules transformers
keeps in float32 (``_keep_in_fp32_modules_strict``: hyper-connections, sinks, position biases, norms) take 4 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from metainfer_gen.llm.plan_model import WEIGHT_FORMATS
from metainfer_gen.llm.plan_v4 import v4_state_bytes

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
HASH_MOE, MOE = "hash_moe", "moe"
KV_ELEMENT_BYTES = {"bf16": 2, "fp8": 1}
_STORAGE_BYTES = {"bf16": 2.0, "fp32": 4.0, "int64": 8.0}
_REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "head_dim", "q_lora_rank",
             "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
             "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "sliding_window", "compress_rates",
             "layer_types", "mlp_layer_types", "max_position_embeddings")


@dataclass(frozen=True, slots=True)
class V4Dims:
    """The dimensions of a DeepSeek-V4 config that decide memory (names as in transformers' ``DeepseekV4Config``).

    Raises:
        ValueError: a non-positive size, layer-type lists of the wrong length or with unknown entries, heads that
            do not split into ``o_groups``.
    """

    model_type: str
    num_layers: int
    hidden: int
    vocab: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate: int
    num_experts: int
    top_k: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    sliding_window: int
    csa_rate: int
    hca_rate: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    max_positions: int
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        sizes = {k: getattr(self, k) for k in ("num_layers", "hidden", "vocab", "num_heads", "head_dim",
                                               "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate",
                                               "num_experts", "top_k", "index_n_heads", "index_head_dim",
                                               "index_topk", "hc_mult", "sliding_window", "csa_rate", "hca_rate",
                                               "max_positions")}
        bad = [k for k, v in sizes.items() if v < 1]
        if bad:
            raise ValueError(f"DeepSeek-V4 sizes must be >= 1; got {', '.join(f'{k}={sizes[k]}' for k in bad)}")
        for name, types, allowed in (("layer_types", self.layer_types, (SLIDING, CSA, HCA)),
                                     ("mlp_layer_types", self.mlp_layer_types, (HASH_MOE, MOE))):
            if len(types) != self.num_layers:
                raise ValueError(f"{name} has {len(types)} entries for num_hidden_layers={self.num_layers}")
            unknown = sorted(set(types) - set(allowed))
            if unknown:
                raise ValueError(f"{name} entries must be in {allowed}; got {unknown}")
        if self.num_heads * self.head_dim % self.o_groups:
            raise ValueError(f"{self.num_heads} heads x {self.head_dim} do not split into o_groups={self.o_groups}")

    @classmethod
    def from_config(cls, cfg: dict) -> "V4Dims":
        """From a config.json dict (``DeepseekV4Config().to_dict()``'s form: benchmarks/configs/deepseek_v4_flash.json).

        Raises:
            ValueError: a required key is missing (all of them named), ``compress_rates`` lacks a rate, or a value
                is out of range; ``n_shared_experts`` other than 1 (transformers builds exactly one shared expert).
        """
        missing = [k for k in _REQUIRED if cfg.get(k) is None]
        if missing:
            raise ValueError(f"DeepSeek-V4 config lacks {missing} (transformers' DeepseekV4Config fields)")
        rates = cfg["compress_rates"]
        lacking = [k for k in (CSA, HCA) if k not in rates]
        if lacking:
            raise ValueError(f"compress_rates lacks {lacking}; got {rates}")
        if cfg.get("n_shared_experts", 1) != 1:
            raise ValueError(f"n_shared_experts={cfg['n_shared_experts']}: transformers' DeepseekV4SparseMoeBlock "
                             "builds exactly one shared expert")
        return cls(model_type=str(cfg.get("model_type", "deepseek_v4")), num_layers=int(cfg["num_hidden_layers"]),
                   hidden=int(cfg["hidden_size"]), vocab=int(cfg["vocab_size"]),
                   num_heads=int(cfg["num_attention_heads"]), head_dim=int(cfg["head_dim"]),
                   q_lora_rank=int(cfg["q_lora_rank"]), o_groups=int(cfg["o_groups"]),
                   o_lora_rank=int(cfg["o_lora_rank"]), moe_intermediate=int(cfg["moe_intermediate_size"]),
                   num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                   index_n_heads=int(cfg["index_n_heads"]), index_head_dim=int(cfg["index_head_dim"]),
                   index_topk=int(cfg["index_topk"]), hc_mult=int(cfg["hc_mult"]),
                   sliding_window=int(cfg["sliding_window"]), csa_rate=int(rates[CSA]), hca_rate=int(rates[HCA]),
                   layer_types=tuple(cfg["layer_types"]), mlp_layer_types=tuple(cfg["mlp_layer_types"]),
                   max_positions=int(cfg["max_position_embeddings"]),
                   tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    @property
    def num_csa_layers(self) -> int:
        return self.layer_types.count(CSA)

    @property
    def num_hca_layers(self) -> int:
        return self.layer_types.count(HCA)

    @property
    def num_hash_layers(self) -> int:
        return self.mlp_layer_types.count(HASH_MOE)

    @property
    def state_config(self) -> dict:
        """The fields :func:`~metainfer_gen.llm.plan_v4.v4_state_bytes` reads."""
        return {"layer_types": list(self.layer_types), "head_dim": self.head_dim,
                "index_head_dim": self.index_head_dim, "sliding_window": self.sliding_window,
                "compress_rates": {CSA: self.csa_rate, HCA: self.hca_rate}}


@dataclass(frozen=True, slots=True)
class V4Tensor:
    """One group of same-kind tensors summed over the layers.

    ``storage``: "linear" (the weight format's bytes), "bf16", "fp32" or "int64" (fixed); ``split``:
    "replicated", "heads" (1/tp), "vocab" (ceil(vocab / tp) rows) or "experts" (ceil(E / ranks) whole experts);
    ``buffer``: a persistent buffer, not a parameter.
    """

    name: str
    numel: int
    storage: str
    split: str
    buffer: bool = False


def v4_tensors(d: V4Dims) -> list[V4Tensor]:
    """Every parameter and persistent router buffer of transformers' ``DeepseekV4ForCausalLM`` for ``d``, grouped
    by name (the prefix of their transformers names: "attn.*" is ``self_attn``, "compressor" / "indexer" its
    ``compressor`` / ``compressor.indexer``, "hc" ``attn_hc``/``ffn_hc``, "experts" / "shared_experts" / "router"
    the ``mlp``). Sources: transformers 5.24 ``modeling_deepseek_v4.py``, the classes named in the module docstring."""
    h, n, hd, di, q = d.hidden, d.num_layers, d.head_dim, d.index_head_dim, d.q_lora_rank
    csa, hca, hc = d.num_csa_layers, d.num_hca_layers, d.hc_mult
    heads_width = d.num_heads * hd
    mix = (2 + hc) * hc  # HyperConnection's pre (n) + post (n) + comb (n x n) weights
    return [
        V4Tensor("embed", d.vocab * h, "bf16", "vocab"),
        V4Tensor("lm_head", 0 if d.tie_embeddings else d.vocab * h, "bf16", "vocab"),
        V4Tensor("final_norm", h, "fp32", "replicated"),
        V4Tensor("hc_head", hc * hc * h + hc + 1, "fp32", "replicated"),
        V4Tensor("attn.q_a", n * h * q, "linear", "replicated"),
        V4Tensor("attn.q_b", n * q * heads_width, "linear", "heads"),
        V4Tensor("attn.kv", n * h * hd, "linear", "replicated"),
        V4Tensor("attn.o_a", n * heads_width * d.o_lora_rank, "linear", "heads"),
        V4Tensor("attn.o_b", n * d.o_groups * d.o_lora_rank * h, "linear", "heads"),
        V4Tensor("attn.norms", n * (q + hd), "fp32", "replicated"),
        V4Tensor("attn.sinks", n * d.num_heads, "fp32", "heads"),
        # kv_proj + gate_proj, 2x wide on CSA (the Ca / Cb halves of overlapping windows)
        V4Tensor("compressor.proj", 2 * h * hd * (2 * csa + hca), "bf16", "replicated"),
        V4Tensor("compressor.bias_norm", d.csa_rate * 2 * hd * csa + d.hca_rate * hd * hca + hd * (csa + hca),
                 "fp32", "replicated"),
        V4Tensor("indexer.proj", csa * (2 * h * 2 * di + h * d.index_n_heads), "bf16", "replicated"),
        V4Tensor("indexer.q_b", csa * q * d.index_n_heads * di, "linear", "replicated"),
        V4Tensor("indexer.bias_norm", csa * (d.csa_rate * 2 * di + di), "fp32", "replicated"),
        V4Tensor("hc", n * 2 * (mix * hc * h + mix + 3), "fp32", "replicated"),
        V4Tensor("layer_norms", n * 2 * h, "fp32", "replicated"),
        V4Tensor("experts", n * d.num_experts * 3 * h * d.moe_intermediate, "linear", "experts"),
        V4Tensor("shared_experts", n * 3 * h * d.moe_intermediate, "linear", "heads"),
        V4Tensor("router", n * d.num_experts * h, "bf16", "replicated"),
        V4Tensor("router.tid2eid", d.num_hash_layers * d.vocab * d.top_k, "int64", "replicated", buffer=True),
        V4Tensor("router.bias", (n - d.num_hash_layers) * d.num_experts, "fp32", "replicated", buffer=True),
    ]


def v4_num_parameters(d: V4Dims) -> int:
    """Parameters of transformers' ``DeepseekV4ForCausalLM`` for ``d`` (``sum(p.numel() for p in
    model.parameters())``; buffers excluded)."""
    return sum(t.numel for t in v4_tensors(d) if not t.buffer)


def v4_weight_bytes_per_rank(d: V4Dims, fmt: str, attn_tp: int, expert_ranks: int) -> float:
    """Bytes of weights and router buffers one rank holds (see the module docstring for the split and storage).

    Args:
        fmt: a key of ``WEIGHT_FORMATS`` ("bf16", "fp8", "int4").
        attn_tp: ranks splitting heads, shared-expert columns and vocabulary (1: attention replicated, as
            data-parallel attention).
        expert_ranks: ranks the routed experts are spread over whole.
    Raises:
        ValueError: unknown format, or a rank count < 1.
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {sorted(WEIGHT_FORMATS)}; got {fmt!r}")
    if attn_tp < 1 or expert_ranks < 1:
        raise ValueError(f"attn_tp and expert_ranks must be >= 1; got {attn_tp}, {expert_ranks}")
    share = {"replicated": 1.0, "heads": 1 / attn_tp, "vocab": -(-d.vocab // attn_tp) / d.vocab,
             "experts": -(-d.num_experts // expert_ranks) / d.num_experts}
    return sum(t.numel * share[t.split] * (WEIGHT_FORMATS[fmt] if t.storage == "linear"
                                           else _STORAGE_BYTES[t.storage]) for t in v4_tensors(d))


def v4_state_bytes_per_sequence(d: V4Dims, context: int, kv_format: str) -> int:
    """Bytes of one sequence's V4 attention state at ``context`` tokens on a rank that holds it
    (:func:`~metainfer_gen.llm.plan_v4.v4_state_bytes`: windows, compressed entries, indexer keys, compressor
    buffers). Under tensor parallelism every rank holds all of it: the single K=V head, the entries and the
    compressors are replicated, as MLA's latent row is.

    Args:
        kv_format: "bf16" (2 bytes a value) or "fp8" (one e4m3 byte, scale 1, as the engine stores MLA rows).
    Raises:
        ValueError: unknown format; a context below 0 or above ``max_position_embeddings``.
    """
    if kv_format not in KV_ELEMENT_BYTES:
        raise ValueError(f"KV format must be one of {sorted(KV_ELEMENT_BYTES)}; got {kv_format!r}")
    if not 0 <= context <= d.max_positions:
        raise ValueError(f"context {context} is outside [0, max_position_embeddings={d.max_positions}]")
    return v4_state_bytes(d.state_config, context, KV_ELEMENT_BYTES[kv_format])["total"]
