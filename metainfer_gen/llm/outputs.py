"""What the engine returns per request (vLLM's ``RequestOutput``, flattened to one completion)."""

from __future__ import annotations

from dataclasses import dataclass, field

from metainfer_gen.llm.sequence import FinishReason, Sequence


@dataclass(slots=True)
class RequestOutput:
    """One request's result so far.

    Attributes:
        request_id: as given to ``add_request`` (or assigned).
        prompt_token_ids, token_ids: prompt and generated token ids.
        text: decoded ``token_ids`` when the engine has a tokenizer, else "".
        finished: True once the request ended; ``finish_reason`` then says why ("stop", "length", "error").
        error: why the request was refused or failed (``finish_reason`` "error"), else None.
        new_token_ids: tokens added by the step that produced this output (streaming).
        ttft: seconds from arrival to the first token; mean_token_latency: seconds per later token (TPOT).
        num_cached_tokens: prompt tokens served from the prefix cache; num_preemptions: times recomputed.
        logprobs: per generated token, its :class:`~metainfer_gen.llm.logits_processors.TokenLogprobs` (when the
            request's ``SamplingParams.logprobs`` is set, else empty); new_logprobs: those of ``new_token_ids``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    text: str = ""
    error: str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None
    mean_token_latency: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)
    new_logprobs: list = field(default_factory=list)

    @classmethod
    def from_sequence(cls, seq: Sequence, new_token_ids: list[int], text: str = "") -> "RequestOutput":
        new_logprobs = seq.logprobs[len(seq.logprobs) - len(new_token_ids):] if seq.logprobs else []
        return cls(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
                   token_ids=seq.output_token_ids, finished=seq.is_finished, finish_reason=seq.finish_reason,
                   text=text, new_token_ids=new_token_ids, ttft=seq.ttft, mean_token_latency=seq.mean_token_latency,
                   num_cached_tokens=seq.num_cached_tokens, num_preemptions=seq.num_preemptions,
                   logprobs=seq.logprobs, new_logprobs=new_logprobs, error=seq.error)

    @classmethod
    def refused(cls, request_id: str, prompt_token_ids: list[int], error: str) -> "RequestOutput":
        return cls(request_id=request_id, prompt_token_ids=prompt_token_ids, token_ids=[], finished=True,
                   finish_reason=FinishReason.ERROR, error=error)
