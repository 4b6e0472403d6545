"""Server subprocesses a test starts: ``metainfer-gen serve`` read until it prints its URL, and stopping one
(SIGTERM, a bounded wait, then SIGKILL)."""

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


def start_serve(args: list[str], env: dict | None = None, timeout_s: float = 60.0
                ) -> tuple[subprocess.Popen, str, list[str]]:
    """Start ``metainfer-gen serve ARGS`` from this checkout (one torch thread; ``env`` default this process's
    environment) and wait until it prints the URL it serves on. A thread goes on reading its output into the returned
    list, so the pipe never fills.

    Returns:
        (the process, its base URL ending in /v1, the lines it printed, growing while it runs).
    Raises:
        AssertionError: it exited or printed no URL within ``timeout_s`` seconds (it is stopped first; the message
            carries the end of its output).
    """
    import os
    import queue
    import re
    import sys
    import threading
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    proc = subprocess.Popen([sys.executable, "-m", "metainfer_gen.apps.cli", "serve", *args], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    urls: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"on (http://\S+/v1)", line)
            if found:
                urls.put(found.group(1))
        urls.put(None)  # the output ended: the process exited

    threading.Thread(target=read, name="serve-output", daemon=True).start()
    try:
        url = urls.get(timeout=timeout_s)
    except queue.Empty:
        url = None
    if url is None:
        stop_process(proc, 15, 5)
        raise AssertionError(f"the server printed no URL within {timeout_s} s (exit code {proc.poll()}): "
                             f"{''.join(lines)[-3000:]}")
    return proc, url, lines
