"""What one layout serves from a per-rank memory budget: the longest context at a concurrency and the most sequences
at a context, each with the activation of the step the engine sizes its KV pool from, at that context.

The engine's KV sizing (:mod:`metainfer_gen.llm.kv_sizing`) profiles its worst steps at ``max_model_len``: the
largest prefill chunk whose attention reads the whole context and the largest decode batch at that context. That
activation grows with the context (a DSA indexer's float32 scores are (chunk, context): about 5.7 GiB per rank
for DeepSeek-V3.2's 8K chunk at 160K tokens against 0.95 GiB for the first chunk), and the context depends on
what it leaves. Instead of iterating, the largest context ``x`` at concurrency ``C`` with

    activation(x, C) + rows(C) * x * KV bytes per token <= budget     (rows(C): KV rows a rank holds per token)

is found by bisection over whole tokens (and likewise the largest concurrency at a given context). Every value
returned satisfies the inequality at its own context and concurrency, so a plan is self-consistent whether or not
the activation grows monotonically; it is the largest such value where it does (it does past one prefill chunk,
the contexts a plan is for). Plain Python (no torch), read by :mod:`metainfer_gen.llm.plan`.
"""

from __future__ import annotations

from collections.abc import Callable

from metainfer_gen.llm.plan_activations import decode_activation_bytes, prefill_activation_bytes
from metainfer_gen.llm.plan_model import ModelDims

__all__ = ["largest_fitting", "layout_limits", "step_activation_bytes"]


def step_activation_bytes(d: ModelDims, chunk: int, seqs: int, context: int, tp: int, cp: int, dcp: int,
                          n: int) -> float:
    """Bytes a rank of the layout (prefill tp x cp, decode tp = n with KV over dcp ranks) leaves for its worst
    step at ``context`` tokens with ``seqs`` sequences resident: a prefill group's share (1/cp) of a
    ``min(chunk, context)`` chunk, its indexer scored against the whole context, or a decode of ``min(seqs,
    chunk)`` sequences each reading its 1/dcp shard of the context. At cp = dcp = 1, tp = n this is
    :func:`~metainfer_gen.llm.plan_activations.worst_step_activation_bytes` with ``max_model_len = context``, the
    two steps the engine profiles."""
    tokens = min(chunk, context)
    prefill = prefill_activation_bytes(d, -(-tokens // cp), context, tp, n)
    decode = decode_activation_bytes(d, min(seqs, chunk), -(-context // dcp), n, n)
    return max(prefill, decode)


def _rows_per_token(concurrency: int, cp_prefill: int, dcp: int) -> float:
    """KV rows a rank holds per token of context with ``concurrency`` sequences resident: the worse of (a)
    concurrency - 1 in the decode layout (1/dcp of their rows here) plus one being prefilled (1/cp_prefill), and
    (b) all of them decoding."""
    return max((concurrency - 1) / dcp + 1 / cp_prefill, concurrency / dcp)


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest x in [0, upper] with ``fits(x)`` found by bisection, 0 when neither ``upper`` nor a smaller
    value fits; every nonzero result fits."""
    if upper <= 0 or fits(upper):
        return max(0, upper)
    lo, hi = 0, upper  # invariant: lo is 0 or fits, hi does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def layout_limits(d: ModelDims, budget: float, kv_tok: float, chunk: int, tp: int, cp: int, dcp: int,
                  concurrency: int, target: int, limit: int) -> dict:
    """The layout's limits from ``budget`` bytes per rank for activations and KV (device budget minus weights).

    Args:
        kv_tok: bytes of one token's full KV rows (all layers).
        concurrency: sequences resident at once.
        target: the context to serve, 0 for none.
        limit: the model's max positions (caps ``max_context``), 0 for none.
    Returns:
        ``max_context`` (capped by ``limit``) and ``max_context_uncapped`` at ``concurrency``;
        ``max_concurrency`` at ``target`` (None without one); ``planned_context``: ``target`` when it fits at
        ``concurrency``, else ``max_context``, else one chunk (nothing fits); and at that context the step's
        ``activation`` bytes, the ``kv_budget`` bytes left and the ``capacity_tokens`` of full rows they hold.
    """
    n = tp * cp

    def room(x: int, c: int) -> tuple[float, int]:
        left = budget - step_activation_bytes(d, chunk, c, x, tp, cp, dcp, n)
        return left, int(left // kv_tok) if left > 0 else 0

    def fits(x: int, c: int) -> bool:
        return x * _rows_per_token(c, cp, dcp) <= room(x, c)[1]

    # The activation is least at context 0 and at one sequence, so these bound the searches from above.
    upper = int(room(0, concurrency)[1] // _rows_per_token(concurrency, cp, dcp))
    uncapped = largest_fitting(lambda x: fits(x, concurrency), upper)
    longest = largest_fitting(lambda x: fits(x, concurrency), min(upper, limit)) if limit else uncapped
    planned = target if target and uncapped >= target else longest or min(chunk, limit or chunk)
    conc = None
    if target:
        cap = room(target, 1)[1]
        bound = max(0, int(min((cap / target - 1 / cp) * dcp + 1, cap * dcp / target) + 1e-9))
        conc = largest_fitting(lambda c: fits(target, c), bound)
    left, tokens = room(planned, concurrency)
    return {"activation": budget - left, "kv_budget": max(0.0, left), "capacity_tokens": tokens,
            "planned_context": planned, "max_context": longest, "max_context_uncapped": uncapped,
            "max_concurrency": conc}
