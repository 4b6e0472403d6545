"""What happens to a step's logits between the model and the sampler, for every sampling row at once: penalties
(repetition, frequency, presence), ``min_tokens``, and the log-probabilities a request asked for.

Batched over rows: per-row settings become (R, 1) tensors and seen tokens a (R, V) count matrix filled by one
``index_put_``, so the cost does not grow with a Python loop over rows. Steps where no row uses a feature skip it.
The penalties follow vLLM's ``apply_penalties``: the repetition penalty (Keskar et al. 2019, CTRL) on the tokens
of the prompt and the output first, then OpenAI's frequency and presence penalties on the output's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probabilities of one sampled token.

    Attributes:
        token_id: the sampled token; logprob: its log-probability (natural log).
        top: ``(token id, logprob)`` of the most likely tokens, best first (as many as the request asked for).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """(R, V) float32: how often each token occurs in each row's list."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    if int(lengths.sum()) == 0:
        return counts
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    """(R, V) float32 logits -> the same with each row's repetition, frequency and presence penalties applied.

    Args:
        logits: one row per sampling sequence.
        seqs: the R :class:`~metainfer_gen.llm.sequence.Sequence` objects (their params and tokens so far).
    """
    params = [seq.params for seq in seqs]
    if not any(p.has_penalties for p in params):
        return logits
    vocab, device = logits.shape[1], logits.device
    output = token_counts([seq.output_token_ids for seq in seqs], vocab, device)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([float(getattr(p, name)) for p in params], device=device).unsqueeze(1)

    repetition = column("repetition_penalty")
    if bool((repetition != 1.0).any()):
        seen = (output > 0) | (token_counts([seq.prompt_token_ids for seq in seqs], vocab, device) > 0)
        factor = torch.where(seen, repetition, torch.ones_like(repetition))
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - column("frequency_penalty") * output - column("presence_penalty") * (output > 0)
    # a repetition penalty near 0 (5e-324 is a valid one, 0 in float32) sends a seen token's logit to +inf: keep
    # it the largest finite value, so the row stays sampleable (the seen token wins, as the penalty asks)
    limit = torch.finfo(logits.dtype).max
    return logits.clamp_(-limit, limit)


def mask_early_stops(logits: torch.Tensor, seqs: list, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Rows short of their ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` at -inf."""
    stops = []
    for seq in seqs:  # the token lists are Python data; the masking below is one tensor operation
        params = seq.params
        early = seq.num_output_tokens < params.min_tokens
        stops.append(list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids)) if early
                     else [])
    if not any(stops):
        return logits
    hit = token_counts(stops, logits.shape[1], logits.device) > 0
    return logits.masked_fill(hit, float("-inf"))


def compute_logprobs(logits: torch.Tensor, tokens: list[int], seqs: list) -> dict[int, TokenLogprobs]:
    """``seq_id -> TokenLogprobs`` for the rows whose request asked for logprobs (log-softmax of ``logits``)."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not rows:
        return {}
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits.index_select(0, index).float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logits.device)).squeeze(1)
    k = max(seqs[i].params.logprobs for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    chosen, top_values, top_ids = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    return {seqs[i].seq_id: TokenLogprobs(tokens[i], chosen[n],
                                          tuple(zip(top_ids[n][:seqs[i].params.logprobs],
                                                    top_values[n][:seqs[i].params.logprobs])))
            for n, i in enumerate(rows)}
