"""Back-pressure and liveness of the LLM server, live on a free loopback port: a burst past
``--max-queued-requests`` gets 429 with ``Retry-After`` in OpenAI's error JSON and every admitted request is
answered whole; ``/health`` answers 503 while the engine has not stepped for ``--health-step-timeout`` seconds with
requests waiting, and 200 again once it steps; a chat without ``max_tokens`` gets what the KV pool holds."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.conftest import MODEL, NUM_KV_BLOCKS, free_blocks, wait_idle

MAX_NUM_SEQS = 2
MAX_QUEUED = 2
STEP_TIMEOUT_S = 1.0
MAX_TOKENS = 8


class GatedStep:
    """Wraps the engine's ``step`` so a test can hold the engine thread inside a step (a hung engine), then let
    it go; ``inside`` is set while a step waits at the gate."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step
        self.gate, self.inside = threading.Event(), threading.Event()
        self.gate.set()
        engine.step = self

    def __call__(self):
        if not self.gate.is_set():
            self.inside.set()
            if not self.gate.wait(60):  # bounded: a test that forgot to open it fails, it does not hang
                raise TimeoutError("the test's gate stayed closed for 60 s")
            self.inside.clear()
        return self.step()

    def restore(self) -> None:
        self.gate.set()
        self.engine.step = self.step


@pytest.fixture(scope="module")
def gated():
    from metainfer_gen.serve.server import LLMServer, ServeConfig

    server = LLMServer.start(ServeConfig(port=0, max_num_seqs=MAX_NUM_SEQS, engine={"num_kv_blocks": 64},
                                         admission={"max_queued_requests": MAX_QUEUED,
                                                    "health_step_timeout_s": STEP_TIMEOUT_S}))
    gate = GatedStep(server.front.engine)
    yield server, gate
    gate.restore()
    server.close()


def _complete(base: str, i: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": f"Count {i}:", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def test_a_burst_past_the_queue_gets_429_and_loses_nothing_admitted(gated):
    server, gate = gated
    base = server.base_url.removesuffix("/v1")
    gate.gate.clear()
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(_complete, base, 0)
        assert gate.inside.wait(30), "the engine never reached its step"
        others = [pool.submit(_complete, base, i) for i in range(1, 8)]
        deadline = time.monotonic() + 30
        while sum(f.done() for f in others) < 4 and time.monotonic() < deadline:  # the refusals come back at once
            time.sleep(0.02)
        refused = [f.result() for f in others if f.done()]
        gate.gate.set()
        answers = [first.result(60)] + [f.result(60) for f in others]
    assert len(refused) == 4 and all(r.status_code == 429 for r in refused)
    for response in refused:
        assert response.headers["Retry-After"] == "1"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "queue_full")
        assert "--max-queued-requests 2" in error["message"]
    admitted = [r for r in answers if r.status_code == 200]
    assert len(admitted) == MAX_NUM_SEQS + MAX_QUEUED
    for response in admitted:  # every admitted request answered whole
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == MAX_TOKENS
    wait_idle(server)
    assert free_blocks(server)[0] == free_blocks(server)[1]
    assert _complete(base, 99).status_code == 200  # the queue drained: admitted again


def test_health_is_503_while_the_engine_does_not_step_with_requests_waiting(gated):
    server, gate = gated
    base = server.base_url.removesuffix("/v1")
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    gate.gate.clear()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_complete, base, 1)
        try:
            assert gate.inside.wait(30)
            deadline, health = time.monotonic() + 15, None
            while time.monotonic() < deadline:
                started = time.monotonic()
                health = httpx.get(f"{base}/health", timeout=5)
                assert time.monotonic() - started < 1.0  # /health itself stays fast
                if health.status_code == 503:
                    break
                time.sleep(0.1)
            assert health.status_code == 503, health.text
            error = health.json()["error"]
            assert error["type"] == "service_unavailable" and "has not stepped for" in error["message"]
            assert "--health-step-timeout 1" in error["message"]
        finally:
            gate.gate.set()
        assert waiting.result(60).status_code == 200
    wait_idle(server)
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200  # stepping again, nothing waits


def _chat_of_length(http, num_tokens: int) -> list[dict]:
    """Messages whose chat prompt is ``num_tokens`` tokens long (found through ``/tokenize``, bounded)."""
    length = num_tokens
    for _ in range(10):  # the embedded tokenizer has a token per character: one or two rounds
        messages = [{"role": "user", "content": "a" * length}]
        count = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]
        if count == num_tokens:
            return messages
        length += num_tokens - count
    raise AssertionError(f"no chat of {num_tokens} tokens found (last {count})")


def test_a_chat_without_max_tokens_gets_what_the_kv_pool_holds(server, http):
    """The session server's pool (120 blocks of 16) is smaller than the 2,048-token context: a chat without
    max_tokens is answered with what the pool holds, not refused for the context it cannot hold."""
    capacity = NUM_KV_BLOCKS * 16
    assert capacity < server.front.engine.max_model_len
    messages = _chat_of_length(http, capacity - 12)  # 12 tokens of room in the pool
    done = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0,
                                                   "ignore_eos": True})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 12 and done.json()["choices"][0]["finish_reason"] == "length"
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "stream": True, "messages": [
            {"role": "user", "content": "Tell me a long story."}]}) as chat:
        assert chat.status_code == 200
        lines = []
        for line in chat.iter_lines():  # a few chunks are enough: then the client leaves (the server aborts it)
            lines.append(line)
            if len(lines) >= 6:
                break
    assert any('"content"' in line for line in lines)
    wait_idle(server)
    assert free_blocks(server)[0] == free_blocks(server)[1]
