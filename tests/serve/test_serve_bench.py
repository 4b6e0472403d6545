"""The serving benchmark's load generator (benchmarks/serve_client.py): SSE timing and vLLM's statistics, against
a canned stream (no server, no model)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def client_module():
    httpx = pytest.importorskip("httpx")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import serve_client
    finally:
        sys.path.remove(str(BENCHMARKS))
    return serve_client, httpx


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def test_send_times_text_chunks_and_reads_usage(client_module):
    serve_client, httpx = client_module
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        body = _sse([{"choices": [{"text": ""}]}, {"choices": [{"text": " a"}]}, {"choices": [{"text": " b"}]},
                     {"choices": [{"text": " c"}]}, {"choices": [], "usage": {"completion_tokens": 3}}])
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await serve_client.send(client, "http://x/v1", "m", [5, 6, 7], 3)

    result = asyncio.run(go())
    assert result.ok and result.num_output_tokens == 3 and result.num_prompt_tokens == 3
    assert len(result.itl) == 2  # three text chunks: the empty one counts for nothing
    assert 0 < result.ttft <= result.e2e
    assert result.tpot == pytest.approx((result.e2e - result.ttft) / 2)
    assert seen["ignore_eos"] is True and seen["stream"] is True and seen["max_tokens"] == 3
    assert seen["stream_options"] == {"include_usage": True}


def test_send_reports_http_errors_as_failed_results(client_module):
    serve_client, httpx = client_module

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(400, json={"error": {"message": "no"}}))
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve_client.send(client, "http://x/v1", "m", [5], 3)

    result = asyncio.run(go())
    assert not result.ok and result.error.startswith("HTTP 400")


def test_summary_matches_vllm_definitions(client_module):
    serve_client, _ = client_module
    s = serve_client.summarize([10, 30], [4, 4], [0.1, 0.3], [0.02, 0.04], [0.01, 0.03], seconds=2.0)
    assert (s.request_throughput, s.input_throughput, s.output_throughput) == (1.0, 20.0, 4.0)
    assert s.total_throughput == 24.0
    assert s.ttft_ms[0] == pytest.approx(200.0) and s.ttft_ms[2] == pytest.approx(298.0)  # linear interpolation
    assert serve_client.summarize([1], [1], [0.1], [], None, 1.0).itl_ms is None


def test_run_load_needs_exactly_one_of_concurrency_and_rate(client_module):
    serve_client, _ = client_module
    with pytest.raises(ValueError, match="exactly one"):
        serve_client.run_load("http://x/v1", "m", [[1]], 1)
    with pytest.raises(ValueError, match="exactly one"):
        serve_client.run_load("http://x/v1", "m", [[1]], 1, concurrency=1, rate=1.0)
