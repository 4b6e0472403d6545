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


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for the session (see ``tests/serve/postgres_cluster.py``): the one at
    ``$METAINFER_GEN_TEST_PG``, else one started here. Skips without PostgreSQL binaries, unless ``CI=true``."""
    import os

    from tests.serve.postgres_cluster import ENV_URL, PostgresCluster, postgres_bindir

    pytest.importorskip("psycopg", reason="the PostgreSQL tests need the fleet extra: "
                                          "pip install 'metainfer-gen[fleet]'")
    if os.environ.get(ENV_URL):
        yield _ExternalCluster(os.environ[ENV_URL])
        return
    if postgres_bindir() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true and no PostgreSQL binaries: install Debian's postgresql (.ci/run does)")
        pytest.skip("no PostgreSQL binaries (apt-get install postgresql)")
    cluster = PostgresCluster()
    try:
        cluster.start()
    except RuntimeError as exc:
        pytest.fail(f"PostgreSQL did not start: {exc}")
    yield cluster
    cluster.remove()


class _ExternalCluster:
    """A server someone else started (its address's database ``postgres`` is the maintenance one)."""

    def __init__(self, url: str):
        self.base = url.rsplit("/", 1)[0]

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"{self.base}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"{self.base}/{name}"


@pytest.fixture
def postgres_url(postgres, request):
    """A fresh database on the session's server for one test."""
    import re

    return postgres.create_database("t_" + re.sub(r"\W", "_", request.node.name)[:50].lower())


@pytest.fixture(params=["sqlite", "postgresql"])
def opener(request, tmp_path):
    """``opener(**options)`` opens another connection to one store of the parametrised backend."""
    address = str(tmp_path / "jobs.sqlite3") if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    from metainfer_gen.serve.video.stores import open_job_store

    opened = []

    def open_store(**options):
        opened.append(open_job_store(address, **options))
        return opened[-1]

    yield open_store
    for store in opened:
        store.close()
