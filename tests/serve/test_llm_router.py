"""Two LLM replicas (``metainfer-gen serve --video none``) behind HAProxy with the shipped configuration
(``docs/fleet/haproxy-llm.cfg``): 32 concurrent streams all complete across both; after ``kill -9`` of one replica
the streams in flight on it end with an error (no hang) and new requests keep succeeding on the other."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.serve.postgres_cluster import free_port
from tests.serve.processes import stop_process, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docs" / "fleet" / "haproxy-llm.cfg"
START_TIMEOUT_S = 120

if shutil.which("haproxy") is None:
    pytest.skip("no haproxy (apt-get install haproxy; .ci/run installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    folder = tmp_path_factory.mktemp("router")
    ports = [free_port() for _ in range(3)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs: list[subprocess.Popen] = []
    try:
        for i in range(2):
            log = folder / f"replica{i}.log"
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "metainfer_gen.apps.cli", "serve", "--video",
                                               "none", "--port", str(ports[i]), "--log-level", "warning"],
                                              cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        for i in range(2):
            wait_healthy(f"http://127.0.0.1:{ports[i]}", procs[i], folder / f"replica{i}.log", START_TIMEOUT_S)
        router_env = dict(env, ROUTER_BIND=f"127.0.0.1:{ports[2]}", REPLICA_0=f"127.0.0.1:{ports[0]}",
                          REPLICA_1=f"127.0.0.1:{ports[1]}")
        with open(folder / "haproxy.log", "w") as out:
            procs.append(subprocess.Popen(["haproxy", "-db", "-f", str(CONFIG)], env=router_env, stdout=out,
                                          stderr=subprocess.STDOUT))
        wait_healthy(f"http://127.0.0.1:{ports[2]}", procs[2], folder / "haproxy.log", START_TIMEOUT_S)
        yield {"url": f"http://127.0.0.1:{ports[2]}", "replicas": procs[:2]}
    finally:
        for proc in procs:
            stop_process(proc)


def stream(url: str, max_tokens: int, results: list, timeout_s: float = 60.0) -> None:
    """One streamed completion through the router; appends (replica, finished, error, seconds)."""
    import httpx

    started, replica, finished, error = time.monotonic(), None, False, None
    body = {"model": "demo_llm", "prompt": "the pass key is", "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as answer:
            replica = answer.headers.get("x-served-by")
            answer.raise_for_status()
            for line in answer.iter_lines():
                if line == "data: [DONE]":
                    finished = True
                elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                    error = line
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    results.append((replica, finished, error, time.monotonic() - started))


def test_32_concurrent_streams_complete_across_both_replicas(router):
    results: list = []
    threads = [threading.Thread(target=stream, args=(router["url"], 32, results)) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 32 and all(r[1] and r[2] is None for r in results), results
    served = {name: sum(r[0] == name for r in results) for name in ("replica0", "replica1")}
    print(f"32 streams: {served}, slowest {max(r[3] for r in results):.2f} s")
    assert min(served.values()) >= 1


def test_kill_9_of_a_replica_ends_its_streams_and_new_requests_succeed(router):
    results: list = []
    threads = [threading.Thread(target=stream, args=(router["url"], 1500, results)) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the streams are running on both replicas
    victim = router["replicas"][0]
    os.kill(victim.pid, signal.SIGKILL)
    after: list = []
    for _ in range(10):  # new requests right after the kill: redispatched, then routed by the health check alone
        stream(router["url"], 8, after, timeout_s=30)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    on_dead = [r for r in results if r[0] == "replica0"]
    print(f"after kill -9: {len(on_dead)} stream(s) on the dead replica ended in "
          f"{max((r[3] for r in on_dead), default=0):.2f} s with errors {[r[2] is not None for r in on_dead]}; "
          f"{sum(r[1] for r in after)}/10 new requests succeeded (the first {after[0][3]:.2f} s after the kill, "
          f"the slowest {max(r[3] for r in after):.2f} s)")
    assert on_dead and all(not r[1] and r[2] is not None for r in on_dead)
    assert all(r[1] and r[0] == "replica1" for r in after), after
