"""Next-token sampling per request: greedy, temperature, top-k, top-p, with a generator per request.

Order of operations as in Hugging Face ``generate`` and vLLM: divide by temperature, keep the top-k logits, keep
the smallest set of tokens whose probability reaches top-p (Holtzman et al. 2020, "The Curious Case of Neural
Text Degeneration"), sample. A request with its own seed draws from its own ``torch.Generator``, so its samples
do not depend on which other requests share the batch.
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


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row.

    Args:
        logits: (R, V) float32.
        params: R sampling settings.
        generators: R CPU generators (None for greedy rows).
    Returns:
        R token ids.
    """
    tokens = logits.argmax(-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        probs = filter_logits(logits[row], p).softmax(-1).cpu()
        tokens[row] = int(torch.multinomial(probs, 1, generator=generators[row]))
    return tokens
