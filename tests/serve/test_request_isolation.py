"""One request's failure stays its own (issue 31, class 1), against the live server: sampling at numeric extremes
works, and a row whose sampling or forward raises ends that request alone while a concurrent stream runs to its end."""

from __future__ import annotations

import asyncio

import httpx
import openai
from tests.serve.conftest import MODEL, free_blocks, wait_idle

STREAM_TOKENS = 300  # long enough that the other request is computed in the same engine steps


async def _stream_beside(server, others: list[dict], side=None) -> tuple[int, str | None, list]:
    """Open a greedy stream, send ``others`` (completions bodies, one after the other; or run
    ``await side(client)``) once the stream has its first token, then read the stream to its end: (its completion
    tokens, its finish reason, the responses or what ``side`` returned)."""
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as client, \
            httpx.AsyncClient(base_url=server.base_url.removesuffix("/v1"), timeout=60) as http:
        stream = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=STREAM_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = aiter(stream)
        first = await asyncio.wait_for(anext(chunks), 30)
        reason, usage = first.choices[0].finish_reason if first.choices else None, None
        responses = [await http.post("/v1/completions", json=other) for other in others]
        if side is not None:
            responses.append(await side(client))
        async for chunk in chunks:
            if chunk.choices:
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return usage.completion_tokens, reason, responses


EXTREMES = [{"temperature": 1e-40}, {"temperature": 1e30, "seed": 2**64 - 1}, {"temperature": 1.7e308},
            {"top_p": 1e-30, "temperature": 1e-30}, {"top_k": 2**62, "top_p": 1e-30},
            {"top_k": 2**62, "seed": 2**64 - 1}]


def test_numeric_extremes_are_sampled_beside_an_innocent_stream(server):
    bodies = [{"model": MODEL, "prompt": "The pass key is", "max_tokens": 8, "ignore_eos": True, **sampling}
              for sampling in EXTREMES]
    tokens, reason, responses = asyncio.run(asyncio.wait_for(_stream_beside(server, bodies), 120))
    for sampling, response in zip(EXTREMES, responses):
        assert response.status_code == 200, (sampling, response.text)
        assert response.json()["usage"]["completion_tokens"] == 8
    assert (tokens, reason) == (STREAM_TOKENS, "length")
    wait_idle(server)
    assert free_blocks(server)[0] == free_blocks(server)[1]


def test_a_request_whose_row_raises_fails_alone(server, monkeypatch):
    """A fault injected into the per-row processing of one request (seed 666): that request gets a 500 naming no
    internal detail, with its id; the stream computed in the same steps gets every token."""
    from metainfer_gen.llm import model_runner

    real = model_runner.apply_penalties

    def poisoned(logits, seqs):
        if any(seq.params.seed == 666 for seq in seqs):
            raise RuntimeError("injected fault in /srv/secret/path")
        return real(logits, seqs)

    monkeypatch.setattr(model_runner, "apply_penalties", poisoned)
    body = {"model": MODEL, "prompt": "The pass key is", "max_tokens": 8, "seed": 666, "temperature": 0.8}
    tokens, reason, (response,) = asyncio.run(asyncio.wait_for(_stream_beside(server, [body]), 120))
    assert (tokens, reason) == (STREAM_TOKENS, "length")
    assert response.status_code == 500
    error = response.json()["error"]
    assert "sampling failed (RuntimeError)" in error["message"] and "cmpl-" in error["message"]
    assert "secret" not in response.text and "injected" not in response.text
    monkeypatch.undo()
    wait_idle(server)
    assert free_blocks(server)[0] == free_blocks(server)[1]
    again = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8


def test_a_request_whose_forward_raises_fails_alone(server, monkeypatch):
    """A fault injected into the model's forward whenever one request's prompt is in the step (its prefill): the
    step is rerun in smaller groups, that request alone gets a 500 with its id and no internal detail, the stream
    computed in the same steps gets every token, and the server answers the next requests."""
    engine = server.front.engine
    prompt = "the lazy dog remembers the pass key 4242"
    window = engine.encode(prompt)[-4:]  # its uncached tail: only its prefill carries these four ids in a row
    embed = engine.model.model.embed_tokens
    real = embed.forward

    def poisoned(ids):
        flat = ids.tolist()
        if any(flat[i:i + len(window)] == window for i in range(len(flat) - len(window) + 1)):
            raise RuntimeError("injected fault in /srv/secret/path")
        return real(ids)

    async def send_poisoned(client):
        try:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        except openai.APIStatusError as exc:
            return exc
        return None

    monkeypatch.setattr(embed, "forward", poisoned)  # one attribute store: atomic for the engine thread
    tokens, reason, (failure,) = asyncio.run(asyncio.wait_for(_stream_beside(server, [], send_poisoned), 120))
    assert (tokens, reason) == (STREAM_TOKENS, "length")
    assert isinstance(failure, openai.InternalServerError), failure
    message = failure.body["message"] if isinstance(failure.body, dict) else str(failure.body)
    assert "computing its tokens failed (RuntimeError)" in message and "cmpl-" in message
    assert "secret" not in failure.response.text and "injected" not in failure.response.text
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30) as client:
        other = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert other.usage.completion_tokens == 8  # the fault still in place: other requests are served
        monkeypatch.undo()
        wait_idle(server)
        assert free_blocks(server)[0] == free_blocks(server)[1]
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert again.usage.completion_tokens == 8
