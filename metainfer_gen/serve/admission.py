"""Back-pressure and liveness of the LLM front: how many requests may wait beyond the running batch
(``--max-queued-requests``: a 429 with ``Retry-After`` past it, as a burst must queue or be told to come back, never
crash the server), and whether the engine is making progress (``/health`` 503 when its loop has not stepped for
``--health-step-timeout`` seconds while requests wait: an engine that hangs must not answer 200).
"""

from __future__ import annotations

from metainfer_gen.serve.errors import retry_later

DEFAULT_HEALTH_STEP_TIMEOUT_S = 60.0  # a long prefill on a slow CPU takes seconds; a hung step never ends


def check_llm_admission(front, num_new: int, max_queued: int | None) -> None:
    """Refuse a request of ``num_new`` engine requests (prompts x ``n``) when the queue behind the running batch
    would exceed ``max_queued`` (None: unbounded). Called on the event loop right before the first add, with no
    await between, so a burst is counted exactly (a request's further choices are added after awaits and may
    overshoot the bound by ``num_new - 1``).

    Raises:
        APIError: 429 (OpenAI's type ``requests``, code ``queue_full``) with ``Retry-After``; nothing was queued.
    """
    if max_queued is None:
        return
    running = front.engine.config.max_num_seqs
    queued = max(0, front.num_unfinished - running)
    if front.num_unfinished + num_new > running + max_queued:
        raise retry_later(429, f"the server's queue is full ({queued} requests wait behind the {running} running; "
                               f"--max-queued-requests {max_queued})", "queue_full")


def engine_problem(front, step_timeout_s: float) -> str | None:
    """Why ``front``'s engine is not making progress (its loop stopped, or it has not stepped for more than
    ``step_timeout_s`` seconds while requests wait), or None when it is."""
    if not front.is_alive:
        return "the engine thread has stopped"
    stalled = front.stalled_s()
    if stalled > step_timeout_s:
        return (f"the engine has not stepped for {stalled:.1f} s while {front.num_unfinished} requests wait "
                f"(--health-step-timeout {step_timeout_s:g})")
    return None
