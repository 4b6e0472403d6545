"""DeepSeek-V4's attention-state bytes from its config alone (plain Python, no torch): what one sequence keeps.

Counted as the reference path keeps it (:mod:`metainfer_gen.llm.layers.v4_attention`), per layer:

- every layer: the last ``sliding_window - 1`` K=V rows (``head_dim`` values each; the current token is the
  window's last): bounded, not per token;
- ``compressed_sparse_attention``: one ``head_dim`` entry and one ``index_head_dim`` indexer key per
  ``compress_rates[csa]`` tokens, plus the compressor's and the indexer's pending tokens (projected kv and gate,
  ``2 x`` their width each) and the last closed window's Ca half (kv and gate);
- ``heavily_compressed_attention``: one ``head_dim`` entry per ``compress_rates[hca]`` tokens plus the pending
  tokens' kv and gate.

So per token, once the window is full, a CSA layer adds ``(head_dim + index_head_dim) / 4`` values and an HCA layer
``head_dim / 128`` (DeepSeek-V4 paper, section 2.3). Sources: transformers 5.24 ``DeepseekV4Config`` (field names
and defaults) and its ``DeepseekV4CSACache`` / ``DeepseekV4HCACache``.
"""

from __future__ import annotations

_CSA, _HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def v4_state_bytes(cfg: dict, context: int, element_bytes: int) -> dict[str, int]:
    """Bytes of one sequence's V4 attention state after ``context`` tokens, by part, all layers together.

    Args:
        cfg: a config.json dict (``layer_types``, ``head_dim``, ``index_head_dim``, ``sliding_window``,
            ``compress_rates``).
        context: tokens seen.
        element_bytes: bytes per stored value (4 float32, 2 bf16).
    Returns:
        {"window", "entries", "index_keys", "buffers", "total"} in bytes.
    Raises:
        ValueError: a missing field or an unknown layer type (named).
    """
    missing = [k for k in ("layer_types", "head_dim", "index_head_dim", "sliding_window", "compress_rates")
               if cfg.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}; not a DeepSeek-V4 config")
    d, di, window = int(cfg["head_dim"]), int(cfg["index_head_dim"]), int(cfg["sliding_window"])
    rates = cfg["compress_rates"]
    parts = {"window": 0, "entries": 0, "index_keys": 0, "buffers": 0}
    for i, kind in enumerate(cfg["layer_types"]):
        if kind not in ("sliding_attention", _CSA, _HCA):
            raise ValueError(f"layer_types[{i}] = {kind!r} is not a DeepSeek-V4 attention type")
        parts["window"] += min(context, window - 1) * d
        if kind == _CSA:
            rate = int(rates[_CSA])
            parts["entries"] += context // rate * d
            parts["index_keys"] += context // rate * di
            closed = context >= rate
            for width in (d, di):  # the compressor's, then the indexer's own
                parts["buffers"] += (context % rate) * 2 * (2 * width) + (2 * rate * width if closed else 0)
        elif kind == _HCA:
            rate = int(rates[_HCA])
            parts["entries"] += context // rate * d
            parts["buffers"] += (context % rate) * 2 * d
    out = {k: v * element_bytes for k, v in parts.items()}
    return {**out, "total": sum(out.values())}
