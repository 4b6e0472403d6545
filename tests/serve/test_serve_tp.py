"""``--tp 2`` as one command: ``serve`` starts rank 1 itself, rank 0 serves HTTP, both step the engine (gloo); the
served greedy text equals the one-process engine's, and stopping rank 0 stops every rank. ``generate --tp 2``
prints what ``--tp 1`` prints."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.serve.conftest import MODEL

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
PROMPTS = ["The pass key is 48213. Remember it. What is the pass key? The pass key is", "Once upon a time",
           "数字 7 🙂 and"]
CLI = [sys.executable, "-m", "metainfer_gen.apps.cli"]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_serve_tp2_answers_as_tp1_and_stops_every_rank(offline):
    expected = [o.text for o in offline(PROMPTS, max_new_tokens=12)]
    proc = subprocess.Popen(CLI + ["serve", "--tp", "2", "--video", "none", "--port", "0", "--num-kv-blocks", "64",
                                   "--max-num-seqs", "8", "--log-level", "warning"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers: list[int] = []
    try:
        deadline, url = time.monotonic() + 180, None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            workers += [int(p) for p in re.findall(r"rank \d+ \(pid (\d+)\)", line)]
            found = re.search(r"on (http://\S+/v1)", line)
            url = found.group(1) if found else None
        assert url is not None, f"the server did not start (exit code {proc.poll()})"
        assert len(workers) == 1 and not gone(workers[0])
        # Keep draining the server's output: a full pipe would block its shutdown's last log lines.
        rest: list[str] = []
        threading.Thread(target=lambda: rest.extend(proc.stdout), name="drain-serve-output", daemon=True).start()
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
            whole = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
                     for p in PROMPTS]
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True))
        assert whole == expected and streamed == expected[0]
        for pid in (proc.pid, workers[0]):  # kill -USR1: each rank prints its threads' stacks and goes on
            os.kill(pid, signal.SIGUSR1)

        def both_dumped(text: str) -> bool:  # both ranks' stacks, the worker's inside its lockstep loop
            return text.count("(most recent call first)") >= 2 and "lockstep.py" in text

        deadline, dumped = time.monotonic() + 20, ""
        while not both_dumped(dumped) and time.monotonic() < deadline:
            time.sleep(0.1)
            dumped = "".join(rest)
        assert both_dumped(dumped), dumped[-3000:]
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends rank 0 (the workers are in their own session)
        try:  # about 5 s alone; over 30 s once under the whole suite's load
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid] + workers:  # every thread's stack of both ranks, into the drained output
                os.kill(pid, signal.SIGUSR1)
            time.sleep(3)
            tail = "".join(rest)[-6000:]
            raise AssertionError(f"rank 0 still running 90 s after Ctrl-C; its output and stacks:\n{tail}") from None
        assert code in (0, -signal.SIGINT), "".join(rest)[-3000:]
        deadline = time.monotonic() + 30
        while not gone(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(workers[0]), "rank 1 outlived rank 0 by 30 s"
    finally:
        for pid in [proc.pid] + workers:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


def test_generate_tp2_prints_what_tp1_prints():
    def run(tp: int) -> list[dict]:
        out = subprocess.run(CLI + ["generate", "--tp", str(tp), "--max-new-tokens", "10", "--json", *PROMPTS],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

    one, two = run(1), run(2)
    assert len(one) == len(PROMPTS)
    assert [(r["text"], r["token_ids"]) for r in two] == [(r["text"], r["token_ids"]) for r in one]


def test_under_torchrun_the_world_size_must_equal_tp(monkeypatch):
    from metainfer_gen.apps.tp_launch import start_ranks

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="--tp 2 under torchrun needs --nproc-per-node 2; WORLD_SIZE is 3"):
        start_ranks(2, {"path": None})
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ranks = start_ranks(2, {"path": None})  # torchrun's rank, nothing started
    assert (ranks.rank, ranks.world_size, ranks.workers) == (1, 2, [])
