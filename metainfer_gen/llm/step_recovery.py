"""One request's failure stays its own: when a step's batched forward raises, find the sequences whose rows raise,
end them alone, and finish the step for the others with the tokens they would have had anyway.

The scheduler has allocated the step's KV blocks and advanced nothing when the runner raises (``Scheduler.update``
runs after the forward), so the step can run again on any subset of its sequences: a rerun writes the same KV
slots from the same tokens and positions, and only ``update``, once, after the recovery, appends tokens, counts
computed tokens and registers prefix hashes. A sequence computes the same in any group: its attention reads only its
own blocks, and a block is shared only once committed, which no later step writes (see ``block_manager``).

The groups are found by bisection (a failing group splits in halves; one of ``ONE_BY_ONE`` sequences or fewer runs
them one at a time): fewer than ``2n`` extra forwards for n sequences, about ``2k log2(n)`` for k bad rows. If
every sequence fails on its own, the failure is nobody's request (a broken model, a dead device): the step's first
exception is raised, as before recovery existed. A step of one sequence has nothing to tell apart: that sequence ends
alone, so the requests queued behind it go on. Sampling that fails for a row is already isolated by the runner
(``ModelRunner.last_errors``); this module catches what escapes it: the model's forward and the LM head. Seeded and
greedy rows draw the same tokens as in the whole batch; unseeded random rows share one generator, whose order changes.
"""

from __future__ import annotations

import logging

from metainfer_gen.llm.scheduler import ScheduledSequence, SchedulerOutput

log = logging.getLogger(__name__)

ONE_BY_ONE = 4  # a failing group this small runs one sequence at a time rather than splitting again


def run_step(runner, out: SchedulerOutput) -> tuple[dict[int, int], dict, dict[int, str]]:
    """Run the step; when the batch raises, rerun it in smaller groups (see the module docstring).

    Returns:
        ``(sampled, logprobs, errors)``: ``seq_id -> token`` for the rows that sampled, ``seq_id -> TokenLogprobs``
        for those that asked, and ``seq_id -> reason`` for every sequence that ends with an error this step (the
        reason names the exception's type only: its text, which may hold paths, goes to the log with the request id).
    Raises:
        Exception: the first exception of the step, when every one of its sequences fails on its own.
    """
    try:
        sampled = runner.run(out)
        return sampled, runner.last_logprobs, runner.last_errors
    except Exception as exc:
        if len(out.scheduled) < 2:  # nothing to tell apart: the lone sequence ends alone, the queue goes on
            return {}, {}, _errors([(out.scheduled[0], exc)]) if out.scheduled else {}
        log.warning("a step of %d sequences failed (%s); rerunning them in smaller groups to find the failing rows",
                    len(out.scheduled), type(exc).__name__)
        return _isolate(runner, out.scheduled, exc)


def _isolate(runner, items: list[ScheduledSequence], error: Exception):
    sampled, logprobs, errors = {}, {}, {}
    failed: list[tuple[ScheduledSequence, Exception]] = []
    pending = _split(items)
    while pending:  # bounded: every failing group of two or more is replaced by strictly smaller ones
        group = pending.pop()
        try:
            sampled.update(runner.run(SchedulerOutput(scheduled=group)))
        except Exception as exc:
            if len(group) == 1:
                failed.append((group[0], exc))
            else:
                pending.extend(_split(group))
            continue
        logprobs.update(runner.last_logprobs)
        errors.update(runner.last_errors)
    if len(failed) == len(items):
        log.error("every sequence of the step fails on its own: not a per-request failure")
        raise error
    errors.update(_errors(failed))
    return sampled, logprobs, errors


def _errors(failed: list[tuple[ScheduledSequence, Exception]]) -> dict[int, str]:
    """``seq_id -> reason`` for the sequences whose rows raised, each logged with its request id and traceback."""
    errors = {}
    for item, exc in failed:
        log.error("request %s: computing its row failed; it ends with an error, the rest of the step goes on",
                  item.seq.request_id, exc_info=exc)
        errors[item.seq.seq_id] = (f"computing its tokens failed ({type(exc).__name__}); the server's log has the "
                                   f"details")
    return errors


def _split(group: list[ScheduledSequence]) -> list[list[ScheduledSequence]]:
    """Halves of ``group``, or its sequences one by one when it is small; the first part is run first."""
    if len(group) <= ONE_BY_ONE:
        parts = [[item] for item in group]
    else:
        half = len(group) // 2
        parts = [group[:half], group[half:]]
    return parts[::-1]  # ``pending`` is a stack
