"""The per-row reference sampler: the engine's sampler before it was batched, kept as the definition of the
distribution :mod:`metainfer_gen.llm.sampler` draws from (tests compare the two; ``benchmarks/sampler.py`` times
both).

Order of operations as in Hugging Face ``generate`` and vLLM: divide by temperature, keep the top-k logits, keep
the smallest set of tokens whose probability reaches top-p (Holtzman et al. 2020, "The Curious Case of Neural
Text Degeneration"), sample with ``torch.multinomial``, one Python iteration per row.
"""

from __future__ import annotations

import torch

from metainfer_gen.llm.sequence import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(V,) float32 logits -> temperature-scaled logits with filtered-out tokens at -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly more likely already reach top_p (the top token always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample_reference(logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None]) -> list[int]:
    """One token per row, row by row (greedy rows: argmax).

    Args:
        logits: (R, V) float32. params: R sampling settings. generators: R CPU generators (None for greedy rows).
    Returns:
        R token ids.
    Raises:
        RuntimeError: a row whose filtered probabilities are not finite (``torch.multinomial``'s error), e.g. a
            temperature so small that the scaled logits overflow.
    """
    tokens = logits.argmax(-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        probs = filter_logits(logits[row], p).softmax(-1).cpu()
        tokens[row] = int(torch.multinomial(probs, 1, generator=generators[row]))
    return tokens
