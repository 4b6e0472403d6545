"""One real server for the serve tests: the embedded LLM behind uvicorn on a free loopback port, in a background
thread of this process (so tests can also read the engine's block pool), talked to with the ``openai`` client.

The KV pool is set small (``NUM_KV_BLOCKS`` blocks of 16 tokens, fewer tokens than the 2048-token context) so
that a request too large for the pool can be shown, and so that no memory profile runs at start-up.
"""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra: pip install 'metainfer-gen[serve]'")
pytest.importorskip("openai", reason="the serve tests talk through the openai client (the dev extra)")

NUM_KV_BLOCKS = 120
MODEL = "demo_llm"


@pytest.fixture(scope="session")
def server():
    from metainfer_gen.serve.server import LLMServer, ServeConfig

    srv = LLMServer.start(ServeConfig(port=0, max_num_seqs=64, engine={"num_kv_blocks": NUM_KV_BLOCKS}))
    yield srv
    srv.close()


@pytest.fixture
def client(server):
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture
def http(server):
    import httpx

    with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=30) as c:
        yield c


@pytest.fixture(scope="session")
def offline():
    """The same embedded LLM run offline (no server), the reference for the served text."""
    from metainfer_gen.pipelines.text_generation import TextGenerationPipeline

    return TextGenerationPipeline.from_pretrained(num_kv_blocks=64)


def metric(text: str, name: str) -> float:
    """The value of the series ``name`` (label set ignored: one model) in a Prometheus exposition."""
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    if found is None:
        raise KeyError(f"{name} not in /metrics")
    return float(found.group(1))


def wait_idle(server, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until the engine holds no request; raises if it does not happen in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    engine = server.front.engine
    while server.front.num_open_requests or engine.has_unfinished_requests:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.front.num_open_requests} requests still open after {timeout_s} s")
        time.sleep(0.01)


def free_blocks(server) -> tuple[int, int]:
    pool = server.front.engine.block_manager
    return pool.num_free_blocks, pool.num_blocks
