"""DeepSeek-V4's bytes in the engine's paged KV pool, from its config alone (plain Python, no torch).

The layout is :mod:`metainfer_gen.llm.models.deepseek_v4_engine`'s (the runner allocates it from the model's
``cache_layout``); this count from the config is what the tests hold the allocation to. The pool holds only what
grows with the context (compressed entries and indexer keys); each sequence's window rows and compressor buffers
are bounded and live in its side table, counted by :func:`metainfer_gen.llm.plan_v4.v4_state_bytes` (``window``,
``buffers``), which also gives the least one sequence needs.
"""

from __future__ import annotations

_CSA, _HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def v4_paged_bytes_per_block(cfg: dict, block_size: int, element_bytes: int) -> int:
    """Bytes one block of the engine's paged pool takes for a V4 model, all layers together
    (:mod:`metainfer_gen.llm.models.deepseek_v4_engine`'s layout): ``ceil(block_size / rate)`` entry slots on each
    compressed layer (``head_dim`` values, and the ``index_head_dim`` indexer key on CSA layers); sliding layers
    take none. Against the least state (one entry per ``rate`` tokens) the only excess is that rounding: an HCA
    layer (rate 128) pays one slot in every block, used by one block in ``rate / block_size``. The window rows
    (``sliding_window - 1`` per layer) and the compressors' pending buffers are per sequence, outside the pool.

    Raises:
        ValueError: a missing field or an unknown layer type (named).
    """
    missing = [k for k in ("layer_types", "head_dim", "index_head_dim", "compress_rates") if cfg.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}; not a DeepSeek-V4 config")
    d, di, rates = int(cfg["head_dim"]), int(cfg["index_head_dim"]), cfg["compress_rates"]
    values = 0
    for i, kind in enumerate(cfg["layer_types"]):
        if kind not in ("sliding_attention", _CSA, _HCA):
            raise ValueError(f"layer_types[{i}] = {kind!r} is not a DeepSeek-V4 attention type")
        if kind != "sliding_attention":
            values += -(-block_size // int(rates[kind])) * (d + (di if kind == _CSA else 0))
    return values * element_bytes
