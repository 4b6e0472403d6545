"""Stopping a server subprocess a test started: SIGTERM, a bounded wait, then SIGKILL."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, term_timeout_s: float = 20.0, kill_timeout_s: float = 10.0) -> None:
    """Terminate ``proc`` if it still runs and wait up to ``term_timeout_s`` seconds; kill it if it did not exit
    and wait up to ``kill_timeout_s`` more. A process that already exited is left as it is.

    Raises:
        subprocess.TimeoutExpired: it survived SIGKILL for ``kill_timeout_s`` seconds.
    """
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(term_timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(kill_timeout_s)
