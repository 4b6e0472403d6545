"""One generation request as the engine sees it: tokens, sampling settings, KV blocks, status and timings.

Plain Python (no torch), so the block manager and the scheduler are unit-tested without a model. Follows
nano-vllm's ``engine/sequence.py``; the sampling fields and their checks follow vLLM's ``SamplingParams``.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no KV blocks
    RUNNING = "running"  # admitted; holds KV blocks for its tokens
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence or a stop token was sampled
    LENGTH = "length"  # max_new_tokens or the model's context length was reached
    ERROR = "error"  # refused at admission, or its row could not be computed or sampled (``RequestOutput.error``)


MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's top_logprobs range, vLLM's max_logprobs)
MAX_REPETITION_PENALTY = 100.0  # a bound that keeps the divided logits finite


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next token, per request.

    Args:
        max_new_tokens: tokens to generate at most, >= 1.
        temperature: 0 means greedy (argmax); > 0 divides the logits before sampling.
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        top_p: nucleus sampling, keep the smallest set whose probability reaches top_p; in (0, 1].
        seed: per-request seed, so a request's samples do not depend on what else is in the batch.
        stop_token_ids: extra tokens that end the request (the model's EOS always does unless ``ignore_eos``).
        ignore_eos: keep generating past EOS (benchmarks use it to fix output lengths).
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many tokens (vLLM's ``min_tokens``).
        presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]: subtract ``presence`` from the logit of every
            token already generated and ``frequency`` times its count.
        repetition_penalty: the CTRL / transformers penalty, > 0: the logit of every token of the prompt or the
            output is divided by it when positive and multiplied by it when negative (1 = off).
        logprobs: None, or how many top tokens' log-probabilities to return beside each sampled token's own
            (0 = only the sampled token's), at most ``MAX_LOGPROBS``; from the model's logits before penalties
            and temperature (vLLM's default, "raw logprobs").
    Raises:
        ValueError: any field outside its range, with the accepted range in the message.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1; got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to keep every token; got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token); got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) (a 64-bit generator seed) or None; got "
                             f"{self.seed!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}]; got "
                             f"{self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off); got {value!r}")
        if isinstance(self.repetition_penalty, bool) or not isinstance(self.repetition_penalty, (int, float)) \
                or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off); "
                             f"got {self.repetition_penalty!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}]; got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """A request's tokens and engine state.

    ``token_ids`` holds the prompt followed by the generated tokens. KV for ``token_ids[:num_computed_tokens]``
    is in the cache, in the blocks of ``block_table`` (logical block i = tokens [i*B, (i+1)*B)). A preempted
    sequence keeps its tokens and is recomputed from scratch (vLLM's recompute preemption), so the prompt it
    re-enters with is ``token_ids`` entire.
    """

    token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at the last admission
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache (block manager's mark)
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)  # per output token, when params.logprobs is set (TokenLogprobs)
    error: str | None = None  # why it finished with FinishReason.ERROR (its row could not be computed or sampled)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        self.request_id = self.request_id or str(self.seq_id)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return -(-len(self.token_ids) // block_size)

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size: (index + 1) * block_size]

    def append_token(self, token_id: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        self.token_ids.append(int(token_id))

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def mean_token_latency(self) -> float | None:
        """Mean seconds between consecutive generated tokens (time per output token, TPOT)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)
