"""Byte counts of a DeepSeek-style model from its config alone: weights per rank, KV per token, activation peak.

Plain Python (no torch), read by :mod:`metainfer_gen.llm.plan`. The formulas follow the engine's layers
(``layers/mla.py``, ``layers/moe.py``) for what is split and what is replicated, and the published storage formats
for the options the engine does not run yet:

- MLA latent row per token and layer: ``kv_lora_rank + qk_rope_head_dim`` values (DeepSeek-V2 paper, section 2.1),
  replicated on every tensor-parallel rank (every head reads the same row; vLLM does the same).
- FP8 KV as the engine stores it (``kv_cache_dtype="fp8"``): every value of the row one e4m3 byte, scale 1
  (576 bytes for 512 + 64; FlashMLA's V3.2 format, with float32 scales and a bf16 rope part, takes 656).
- DSA indexer keys (DeepSeek-V3.2, transformers ``DeepseekV32Indexer``): one ``index_head_dim`` key per token on
  each layer that runs its own indexer, in the same cache row as the latent (same dtype).
- Weights: "bf16" everything 2 bytes; "fp8" the decoder's linear layers in e4m3 with one float32 scale per
  128x128 block (DeepSeek's release format), embedding/head/norms bf16, router float32; "int4" the same linears
  at 4 bits with one bf16 scale per 128 inputs (GPTQ/AWQ-style W4A16 group 128).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

WEIGHT_FORMATS = {"bf16": 2.0, "fp8": 1.0 + 4 / (128 * 128), "int4": 0.5 + 2 / 128}
KV_FORMATS = ("fp32", "bf16", "fp8")
_REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The dimensions that decide memory and traffic (names as in transformers' ``DeepseekV3Config``).

    ``q_lora_rank`` 0 means a full q projection; ``num_experts`` 0 means a dense model; ``index_head_dim`` 0 means
    no DSA indexer; ``num_indexer_layers`` counts layers that keep their own indexer keys (GLM-5's "shared" layers
    reuse the previous layer's top-k and keep none).
    """

    model_type: str
    num_layers: int
    hidden: int
    vocab: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    intermediate: int
    moe_intermediate: int
    num_experts: int
    num_shared_experts: int
    top_k: int
    first_k_dense: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_indexer_layers: int
    max_positions: int
    tie_embeddings: bool

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelDims":
        """From a config.json dict.

        Raises:
            ValueError: a required key is missing (named in the message).
        """
        missing = [k for k in _REQUIRED if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config lacks {missing}; the planner needs a DeepSeek-style MLA config")
        layers = int(cfg["num_hidden_layers"])
        index_dim = int(cfg.get("index_head_dim") or 0)
        types = cfg.get("indexer_types")
        indexer_layers = (sum(t == "full" for t in types) if types else layers) if index_dim else 0
        return cls(model_type=str(cfg.get("model_type", "?")), num_layers=layers, hidden=int(cfg["hidden_size"]),
                   vocab=int(cfg["vocab_size"]), num_heads=int(cfg["num_attention_heads"]),
                   q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg["kv_lora_rank"]),
                   qk_nope=int(cfg["qk_nope_head_dim"]), qk_rope=int(cfg["qk_rope_head_dim"]),
                   v_head=int(cfg["v_head_dim"]), intermediate=int(cfg["intermediate_size"]),
                   moe_intermediate=int(cfg.get("moe_intermediate_size") or 0),
                   num_experts=int(cfg.get("n_routed_experts") or 0),
                   num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                   top_k=int(cfg.get("num_experts_per_tok") or 0),
                   first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
                   index_n_heads=int(cfg.get("index_n_heads") or 0), index_head_dim=index_dim,
                   index_topk=int(cfg.get("index_topk") or 0), num_indexer_layers=indexer_layers,
                   max_positions=int(cfg.get("max_position_embeddings") or 0),
                   tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelDims":
        """From a checkpoint directory (its config.json) or a config .json file.

        Raises:
            FileNotFoundError: no such file or directory. ValueError: not a usable config.
        """
        return cls.from_config(read_config(path))

    @property
    def num_moe_layers(self) -> int:
        return 0 if not self.num_experts else self.num_layers - min(self.first_k_dense, self.num_layers)

    @property
    def latent_row(self) -> int:
        """Latent-cache values per token and layer (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope


def read_config(path: str | Path) -> dict:
    """The config.json dict of a checkpoint directory, or of a config .json file.

    Raises:
        FileNotFoundError: no such file or directory. ValueError: not JSON.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config at {str(file)!r}; pass a checkpoint directory or a config .json")
    return json.loads(file.read_text())


def _indexer_params(d: ModelDims) -> int:
    """wq_b (q_lora -> heads x dim), wk (hidden -> dim), k_norm, weights_proj (hidden -> heads)."""
    if not d.index_head_dim:
        return 0
    q_in = d.q_lora_rank or d.hidden
    return q_in * d.index_n_heads * d.index_head_dim + d.hidden * d.index_head_dim + 2 * d.index_head_dim + \
        d.hidden * d.index_n_heads


def weight_bytes_per_rank(d: ModelDims, fmt: str, attn_tp: int, expert_ranks: int) -> float:
    """Bytes of weights one rank holds.

    Args:
        fmt: "bf16", "fp8" or "int4" (see the module docstring for what each covers).
        attn_tp: ranks splitting the attention heads, dense/shared MLP columns and vocabulary.
        expert_ranks: ranks the routed experts are spread over whole (expert parallelism).
    Raises:
        ValueError: unknown format.
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {sorted(WEIGHT_FORMATS)}; got {fmt!r}")
    lin, other = WEIGHT_FORMATS[fmt], 2.0
    qk = d.qk_nope + d.qk_rope
    q_split = (d.q_lora_rank or d.hidden) * d.num_heads * qk
    attn_rep = (d.hidden * d.q_lora_rank if d.q_lora_rank else 0) + d.hidden * d.latent_row
    attn_split = q_split + d.kv_lora_rank * d.num_heads * (d.qk_nope + d.v_head) + d.num_heads * d.v_head * d.hidden
    per_layer = lin * (attn_rep + attn_split / attn_tp + _indexer_params(d)) + other * (
        2 * d.hidden + d.q_lora_rank + d.kv_lora_rank)
    dense = lin * 3 * d.hidden * d.intermediate / attn_tp
    experts = -(-d.num_experts // expert_ranks) if d.num_experts else 0
    moe = lin * 3 * d.hidden * d.moe_intermediate * (experts + d.num_shared_experts / attn_tp) + \
        4.0 * d.num_experts * (d.hidden + 1)
    layers = d.num_layers * per_layer + (d.num_layers - d.num_moe_layers) * dense + d.num_moe_layers * moe
    vocab_rows = -(-d.vocab // attn_tp)
    return layers + other * (vocab_rows * d.hidden * (1 if d.tie_embeddings else 2) + d.hidden)


def kv_bytes_per_token(d: ModelDims, kv_format: str) -> dict[str, float]:
    """KV bytes one token takes over all layers on a rank that holds it, by part.

    Returns:
        {"latent": ..., "indexer": ..., "total": ...} in bytes.
    Raises:
        ValueError: unknown format.
    """
    if kv_format in KV_FORMATS:
        size = {"fp32": 4, "bf16": 2, "fp8": 1}[kv_format]
        latent, index = size * d.latent_row, size * d.index_head_dim
    else:
        raise ValueError(f"KV format must be one of {KV_FORMATS}; got {kv_format!r}")
    parts = {"latent": float(d.num_layers * latent), "indexer": float(d.num_indexer_layers * index)}
    return {**parts, "total": parts["latent"] + parts["indexer"]}
