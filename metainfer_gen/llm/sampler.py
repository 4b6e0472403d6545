"""Next-token sampling for every row of a step at once: greedy, temperature, top-k, top-p, each row drawing from its
own generator, and safe at every setting the request checks allow.

No Python loop over rows does tensor work; the one per-row loop draws a float64 uniform per row (per round) from
that row's generator, and which path a row takes depends on its own logits and settings only, so a seeded
request's tokens never depend on its batch neighbours. The distribution is the reference's
(:mod:`metainfer_gen.llm.sampler_reference`: temperature, then top-k, then top-p, as Hugging Face and vLLM):

- greedy (temperature below :data:`SAMPLING_EPS`, vLLM's ``_SAMPLING_EPS``): argmax.
- top-k with k <= :data:`MAX_TOPK_CANDIDATES`: one ``torch.topk`` over the rows; temperature, the top-k cut and
  top-p are exact within those candidates, and the draw is an inverse CDF over them in token-id order. A row whose
  k-th logit ties the next one (the reference keeps every token tied with the k-th) takes the full path.
- otherwise (the full path): a temperature-scaled softmax over the vocabulary, padded to :data:`BLOCK`-token
  blocks; the draw is an inverse CDF in two levels (block sums, then one block), so no (R, V) cumsum is made.
  Top-p is by rejection (FlashInfer's sorting-free sampling): draw from the whole distribution, accept when the
  mass of the tokens strictly more likely than the drawn one is below top_p, else zero every token no more likely
  than it and draw again; an accepted draw follows the nucleus distribution exactly. Rows still drawing after
  :data:`MAX_REJECTIONS` rounds take their nucleus by a sort.

Ties at the top-p cut keep every tied token (the reference keeps an arbitrary part of them, in its sort's order).
Numerics: 1/temperature is clamped to at least :data:`MIN_INV_TEMPERATURE`, so a huge temperature gives the
uniform distribution over the unmasked tokens instead of ``-inf * 0``; a row whose logits hold NaN or +inf, or
are all -inf, is an error of that row alone (:class:`Sampled`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from metainfer_gen.llm.sequence import SamplingParams

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (the limit of the distribution; vLLM's threshold)
MIN_INV_TEMPERATURE = 1e-30  # 1 / the largest temperature that still scales (beyond: uniform, in float32)
BLOCK = 256  # tokens per block of the two-level inverse CDF
MAX_TOPK_CANDIDATES = 1024  # top_k up to this takes the candidate path (torch.topk grows with k)
MAX_REJECTIONS = 16  # top-p rejection rounds before the sort fallback
NOT_FINITE = "the model's logits for this request are not finite (NaN or infinity): no token can be sampled"


@dataclass(frozen=True, slots=True)
class Sampled:
    """One step's draws.

    Attributes:
        tokens: R token ids (-1 for a row in ``errors``).
        errors: row -> why that row could not be sampled; the other rows are unaffected.
    """

    tokens: list[int]
    errors: dict[int, str]


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """(n,) float64 in [0, 1): one draw from each generator (None: torch's default one)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


def _column(values: list[float], dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).unsqueeze(1)


def _keep_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(n, K) probabilities sorted high to low per row -> the same with the tokens outside the top-p nucleus at 0.

    A token stays when the mass of the tokens strictly more likely than it is below ``top_p`` (n, 1); tokens tied
    with it count as not more likely, so a tie group stays or goes whole.
    """
    before = probs.cumsum(-1) - probs
    first = torch.ones_like(probs, dtype=torch.bool)
    first[:, 1:] = probs[:, 1:] != probs[:, :-1]
    positions = torch.arange(probs.shape[1]).expand_as(probs)
    start = torch.where(first, positions, 0).cummax(-1).values  # first index of each token's tie group
    return probs.masked_fill(before.gather(1, start) >= top_p, 0.0)


def _draw_blocks(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from (n, nb * BLOCK) unnormalised probabilities (zeros allowed) with uniforms ``u`` (n,):
    pick the block by the block sums, then the token inside it. Returns (n,) int64 token ids."""
    n = probs.shape[0]
    blocks = probs.view(n, -1, BLOCK)
    cdf = blocks.sum(-1).double().cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    block = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(n), block[:, 0]].double().cumsum(-1)
    token = block * BLOCK + torch.searchsorted(inner, target - before, right=True).clamp_(max=BLOCK - 1)
    drawn = probs.gather(1, token) > 0
    if not bool(drawn.all()):  # float rounding at a block edge landed on a zero: take the likeliest token
        token = torch.where(drawn, token, probs.argmax(-1, keepdim=True))
    return token[:, 0]


def _buffer(scratch: list, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``shape`` view of the reusable buffer ``scratch[slot]`` (grown when too small): a fresh (R, V) tensor per
    step costs more than the pass that fills it (new pages, faulted in by the kernel)."""
    while len(scratch) <= slot:
        scratch.append(None)
    numel = math.prod(shape)
    if scratch[slot] is None or scratch[slot].dtype != dtype or scratch[slot].numel() < numel:
        scratch[slot] = torch.empty(numel, dtype=dtype)
    return scratch[slot][:numel].view(shape)


def _mass_above(probs: torch.Tensor, pivot: torch.Tensor, scratch: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(mass, above)``: mass (n,) float64, per row the sum of the probabilities strictly above ``pivot`` (n, 1);
    above (n, V) those probabilities with every other one 0, or None. Only the blocks whose maximum exceeds the
    pivot are summed when they are few (a peaked distribution; above is None), else every token is, in float
    passes over a reused buffer (``scratch`` slot 1, overwritten by the next call): ``p * (p > pivot)`` with the
    comparison written as 1.0 / 0.0 floats (:func:`_above`) is exactly ``p`` above the pivot and 0 elsewhere."""
    n = probs.shape[0]
    blocks = probs.view(n, -1, BLOCK)
    hot = blocks.amax(-1) > pivot
    if int(hot.sum()) * 8 > hot.numel():  # a flat distribution: gathering the blocks would cost more
        above = _above(probs, pivot, _buffer(scratch, 1, tuple(probs.shape), probs.dtype)).mul_(probs)
        return above.sum(-1).double(), above
    rows, cols = hot.nonzero(as_tuple=True)
    values = blocks[rows, cols]
    part = (values * (values > pivot[rows])).sum(-1).double()
    return torch.zeros(n, dtype=torch.float64).index_add_(0, rows, part), None


def _above(probs: torch.Tensor, pivot: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (float) = 1.0 where ``probs`` (n, V) exceeds ``pivot`` (n, 1), else 0.0: the comparison written
    straight into the float buffer, one pass (a bool result, then a cast or ``where``, cost 3-4x; the earlier
    ``sign(max(p - pivot, 0))`` three passes: 7.4 against 5.5 ms with the product and sum at 64 x 129,280)."""
    return torch.gt(probs, pivot, out=out)


def _full_probs(logits: torch.Tensor, inv_t: torch.Tensor, threshold: torch.Tensor | None,
                scratch: list) -> torch.Tensor:
    """(n, V) logits -> (n, nb * BLOCK) softmax of ``logits * inv_t`` with logits below ``threshold`` (n, 1) and
    the padding at probability 0, written into ``scratch[0]`` (a flat float32 buffer, replaced when too small)."""
    n, vocab = logits.shape
    padded = -(-vocab // BLOCK) * BLOCK
    scaled = _buffer(scratch, 0, (n, padded), torch.float32)
    scaled[:, vocab:] = float("-inf")
    torch.mul(logits, inv_t, out=scaled[:, :vocab])
    if threshold is not None:
        scaled[:, :vocab].masked_fill_(logits < threshold, float("-inf"))
    # In place: a second (R, V) buffer costs as much as the softmax itself (fresh pages on every step).
    return torch.ops.aten._softmax.out(scaled, -1, False, out=scaled)


def _sample_full(logits, inv_t, threshold, top_p: list[float], generators, scratch: list) -> torch.Tensor:
    """The full path for (n, V) ``logits``: (n,) tokens."""
    probs = _full_probs(logits, inv_t, threshold, scratch)
    tokens = _draw_blocks(probs, _uniforms(generators))
    alive = [i for i, p in enumerate(top_p) if p < 1.0]
    if not alive:
        return tokens
    probs = probs if len(alive) == len(top_p) else probs[alive]  # (rejected rows are copied before masking)
    for _ in range(MAX_REJECTIONS):
        pivot = probs.gather(1, tokens[alive].unsqueeze(1))
        cut = torch.tensor([top_p[i] for i in alive], dtype=torch.float64)
        mass, above = _mass_above(probs, pivot, scratch)
        keep = (mass >= cut).nonzero()[:, 0]
        if keep.numel() == 0:
            return tokens
        alive = [alive[i] for i in keep.tolist()]
        # Tokens no more likely than a rejected one are outside the nucleus: the rejected rows keep only those
        # above their pivot (already computed on a flat distribution; a copy, as the buffer is reused).
        if above is not None:
            probs = above[keep]
        else:
            probs = probs[keep]
            probs.mul_(_above(probs, pivot[keep], _buffer(scratch, 1, tuple(probs.shape), probs.dtype)))
        tokens[alive] = _draw_blocks(probs, _uniforms([generators[i] for i in alive]))
    ordered, order = probs.sort(-1, descending=True)
    nucleus = _keep_nucleus(ordered, _column([top_p[i] for i in alive]))
    tokens[alive] = _draw_blocks(torch.zeros_like(probs).scatter_(1, order, nucleus),
                                 _uniforms([generators[i] for i in alive]))
    return tokens


def _sample_candidates(values, ids, k: list[int], inv_t, top_p: list[float], generators) -> torch.Tensor:
    """The candidate path: (n, K) top logits (high to low) and their token ids -> (n,) tokens."""
    positions = torch.arange(values.shape[1]).expand_as(values)
    scaled = (values * inv_t).masked_fill(positions >= torch.tensor(k).unsqueeze(1), float("-inf"))
    probs = _keep_nucleus(scaled.softmax(-1), _column(top_p))
    order = ids.argsort(-1)  # token-id order: the draw does not depend on how topk ordered equal logits
    ids, probs = ids.gather(1, order), probs.gather(1, order)
    cdf = probs.double().cumsum(-1)
    pick = torch.searchsorted(cdf, (_uniforms(generators) * cdf[:, -1]).unsqueeze(1), right=True)
    pick = pick.clamp_(max=probs.shape[1] - 1)
    drawn = probs.gather(1, pick) > 0
    pick = torch.where(drawn, pick, probs.argmax(-1, keepdim=True))
    return ids.gather(1, pick)[:, 0]


class Sampler:
    """:func:`sample` with a scratch buffer kept between steps (the engine's runner holds one): a fresh (R, V)
    buffer per step costs about as much as the softmax written into it (new pages, zeroed by the kernel)."""

    def __init__(self):
        self._scratch: list = [None]

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> Sampled:
        return sample(logits, params, generators, self._scratch)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           scratch: list | None = None) -> Sampled:
    """Pick one token per row.

    Args:
        logits: (R, V) float32 (other float dtypes are upcast; another device's are copied to the CPU).
        params: R sampling settings.
        generators: R CPU generators; None for greedy rows (a sampling row with None draws from torch's
            default generator).
        scratch: ``[buffer or None]``, a float32 buffer this call may use and replace (see :class:`Sampler`).
    Returns:
        :class:`Sampled`: the tokens, and the rows whose logits are not finite (those rows only).
    """
    scratch = [None] if scratch is None else scratch
    logits = logits.float().cpu()  # the generators are CPU ones (as the per-row sampler's were): draw there
    num_rows, vocab = logits.shape
    finite = torch.isfinite(logits.amax(-1)).tolist()
    errors = {r: NOT_FINITE for r in range(num_rows) if not finite[r]}
    tokens = torch.full((num_rows,), -1, dtype=torch.long)
    greedy, topk, full = [], [], []
    for r, p in enumerate(params):  # Python data only: which path each row takes
        if r in errors:
            continue
        k = p.top_k if 0 < p.top_k < vocab else 0
        (greedy if p.temperature < SAMPLING_EPS else topk if 0 < k <= MAX_TOPK_CANDIDATES else full).append(r)

    def rows(index: list[int]) -> torch.Tensor:
        return logits if len(index) == num_rows else logits[index]

    if greedy:
        tokens[greedy] = rows(greedy).argmax(-1)
    inv = {r: max(1.0 / params[r].temperature, MIN_INV_TEMPERATURE) for r in topk + full}
    threshold: dict[int, float] = {}
    if topk:
        k = [params[r].top_k for r in topk]
        values, ids = rows(topk).topk(max(k) + 1, -1)
        cut = values.gather(1, torch.tensor(k).unsqueeze(1) - 1)[:, 0]
        covered = (values.gather(1, torch.tensor(k).unsqueeze(1))[:, 0] < cut).tolist()
        threshold = {r: float(c) for r, c, ok in zip(topk, cut.tolist(), covered) if not ok}
        sel = [i for i, ok in enumerate(covered) if ok]
        if sel:
            picked = [topk[i] for i in sel]
            tokens[picked] = _sample_candidates(values[sel], ids[sel], [k[i] for i in sel],
                                                _column([inv[r] for r in picked]),
                                                [params[r].top_p for r in picked], [generators[r] for r in picked])
        full = sorted(full + list(threshold))
    for r in full:
        if MAX_TOPK_CANDIDATES < params[r].top_k < vocab:  # a large top_k: its cut by kthvalue, per row (rare)
            threshold[r] = float(logits[r].kthvalue(vocab - params[r].top_k + 1).values)
    if full:
        cut = _column([threshold.get(r, float("-inf")) for r in full]) if threshold else None
        tokens[full] = _sample_full(rows(full), _column([inv[r] for r in full]), cut,
                                    [params[r].top_p for r in full], [generators[r] for r in full], scratch)
    return Sampled(tokens.tolist(), errors)
