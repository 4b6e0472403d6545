"""Many clients at once, and clients that leave: continuous batching, and every KV block back in the pool."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from tests.serve.conftest import MODEL, free_blocks, metric, wait_idle

IGNORE_EOS = {"ignore_eos": True}


async def _poll_running(base: str, stop: asyncio.Event, seen: list[float]) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        while not stop.is_set():
            seen.append(metric((await http.get("/metrics")).text, "vllm:num_requests_running"))
            await asyncio.sleep(0.01)


def test_32_concurrent_streaming_clients(server, capsys):
    base = server.base_url.removesuffix("/v1")

    async def one(client, i: int) -> tuple[str, int, str]:
        stream = await client.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=IGNORE_EOS)
        text, usage, reason = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return text, usage.completion_tokens, reason

    async def main():
        stop, seen = asyncio.Event(), []
        poller = asyncio.create_task(_poll_running(base, stop, seen))
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as client:
            results = await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), timeout=60)
            whole = await client.completions.create(model=MODEL, prompt="Story 5:", max_tokens=24, temperature=0,
                                                    extra_body=IGNORE_EOS)
        stop.set()
        await poller
        return results, seen, whole.choices[0].text

    results, seen, whole = asyncio.run(main())
    assert [(n, r) for _, n, r in results] == [(24, "length")] * 32
    assert results[5][0] == whole  # batched with 31 others, the greedy text is the one it gets alone
    with capsys.disabled():
        print(f"\n32 streaming clients: max vllm:num_requests_running seen = {max(seen):.0f} over {len(seen)} scrapes")
    assert max(seen) > 1
    wait_idle(server)
    assert free_blocks(server)[0] == free_blocks(server)[1]


def test_200_requests_a_quarter_disconnecting_mid_stream(server, capsys):
    def aborted() -> float:
        text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text
        try:
            return metric(text, 'vllm:request_success_total{finished_reason="abort",model_name="demo_llm"}')
        except KeyError:
            return 0.0

    before = aborted()

    async def one(client, sem, i: int) -> str | None:
        leaves = i % 4 == 0
        async with sem:
            stream = await client.completions.create(model=MODEL, prompt=f"Item {i} is", temperature=0,
                                                     max_tokens=64 if leaves else 6, stream=True,
                                                     extra_body=IGNORE_EOS)
            n, reason = 0, None
            async for chunk in stream:
                n += 1
                reason = chunk.choices[0].finish_reason
                if leaves and n == 2:
                    await stream.close()  # the client goes away mid-stream: the socket closes
                    return "left"
            return reason

    async def main():
        sem = asyncio.Semaphore(32)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, sem, i) for i in range(200))), timeout=60)

    reasons = asyncio.run(main())
    assert reasons == ["left" if i % 4 == 0 else "length" for i in range(200)]
    wait_idle(server)
    num_free, num_blocks = free_blocks(server)
    with capsys.disabled():
        print(f"\n200 requests, 50 disconnected: {num_free}/{num_blocks} KV blocks free afterwards")
    assert num_free == num_blocks
    assert aborted() - before == 50


def _close_after(server, request, seconds: float) -> tuple[int, float]:
    """Send ``request``, close the socket after ``seconds``; return (engine steps, seconds) until it was idle."""
    start_tokens = metric(httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text,
                          "vllm:generation_tokens_total")
    try:
        request(seconds)
    except httpx.ReadTimeout:
        pass
    steps, t0 = server.front.num_steps, time.monotonic()
    wait_idle(server, timeout_s=5)
    tokens = metric(httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text,
                    "vllm:generation_tokens_total") - start_tokens
    assert 0 < tokens < 1500  # it ran, and it did not run to the end
    return server.front.num_steps - steps, time.monotonic() - t0


def test_client_closing_the_socket_aborts_within_one_step(server, capsys):
    body = {"model": MODEL, "prompt": "Long story:", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}

    def whole(seconds):
        httpx.post(server.base_url + "/completions", json=body, timeout=seconds)

    def streamed(seconds):
        with httpx.stream("POST", server.base_url + "/completions", json=dict(body, stream=True), timeout=10) as r:
            deadline = time.monotonic() + seconds
            for _ in r.iter_lines():
                if time.monotonic() > deadline:
                    break

    for request in (whole, streamed):
        steps, seconds = _close_after(server, request, 0.5)
        with capsys.disabled():
            print(f"\n{request.__name__} request closed after 0.5 s: {steps} engine step(s), {seconds * 1e3:.1f} ms "
                  f"until idle")
        # From the socket closing to the abort call, uvicorn's event loop must notice and get the GIL from the
        # engine thread (a step of this tiny model is ~2 ms): a few steps (the call to its effect: test_async_engine).
        assert steps <= 10 and seconds < 1.0, (request.__name__, steps, seconds)
        assert free_blocks(server)[0] == free_blocks(server)[1]
