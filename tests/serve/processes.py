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


def wait_healthy(url: str, proc: subprocess.Popen, log, timeout_s: float = 120.0) -> None:
    """Poll ``url``/health until it answers 200.

    Raises:
        AssertionError: ``proc`` exited, or ``timeout_s`` seconds passed (with the tail of the ``log`` file).
    """
    import time
    from pathlib import Path

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited ({proc.returncode}): {Path(log).read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not become healthy in {timeout_s} s: {Path(log).read_text()[-3000:]}")
