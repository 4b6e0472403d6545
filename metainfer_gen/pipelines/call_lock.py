"""One call at a time per loaded model, whichever thread calls.

A notebook, a web app or a thread pool often calls one loaded pipeline from several threads at once; the
scheduler's, the step cache's and the engine's per-call state live on the model objects, so overlapping calls
corrupt each other (diffusers' own pipelines are not thread-safe either; a public report: CogVideo issue #370, an
``IndexError`` in the scheduler). Calls are serialised per underlying model: per video transformer (a
text-to-video and an image-to-video pipeline made with ``from_pipe`` share it, its scheduler and its hooks) and
per LLM engine, so each call returns what it returns alone.
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["call_lock"]

_LOCKS: "weakref.WeakKeyDictionary[object, threading.RLock]" = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def call_lock(owner: object) -> threading.RLock:
    """The re-entrant lock serialising calls on ``owner`` (a video transformer, a diffusers pipeline or an LLM engine),
    made on first use and dropped with it."""
    with _GUARD:
        lock = _LOCKS.get(owner)
        if lock is None:
            lock = _LOCKS[owner] = threading.RLock()
        return lock
