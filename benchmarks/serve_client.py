"""The load generator of ``serve_llm.py``: streamed OpenAI completions at a bounded concurrency or at Poisson
arrivals, and the latency statistics of ``vllm bench serve``.

Per request (as vLLM's ``benchmarks/lib/endpoint_request_func.py``): TTFT = send to the first chunk with text,
ITL = the gaps between successive text chunks, TPOT = (e2e - TTFT) / (output tokens - 1), e2e = send to the last
chunk; output tokens come from the final usage chunk (``stream_options.include_usage``). Every request has a
timeout and the whole run a deadline, so a hung server fails the run instead of hanging it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestResult:
    """One streamed request. Times in seconds from its send."""

    num_prompt_tokens: int
    ok: bool = False
    error: str = ""
    num_output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # perf_counter at send

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else None


async def send(client, url: str, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    """POST one streamed completion of ``max_tokens`` tokens (``ignore_eos``, greedy) and time its chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(len(prompt), start=time.perf_counter())
    last = None
    try:
        async with client.stream("POST", f"{url}/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - result.start
        result.ok = last is not None and result.num_output_tokens > 0
        if not result.ok:
            result.error = "stream ended without text or usage"
    except Exception as exc:  # a failed request is a row entry, not a crash of the whole run
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _client(timeout_s: float):
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))


async def _at_concurrency(url, model, prompts, max_tokens, concurrency, timeout_s):
    gate = asyncio.Semaphore(concurrency)
    async with _client(timeout_s) as client:
        async def one(prompt):
            async with gate:
                return await send(client, url, model, prompt, max_tokens)

        return await asyncio.gather(*(one(p) for p in prompts))


async def _at_rate(url, model, prompts, max_tokens, rate, seed, timeout_s):
    rng = random.Random(seed)
    async with _client(timeout_s) as client:
        tasks = []
        for prompt in prompts:  # Poisson process: exponential gaps of mean 1 / rate
            tasks.append(asyncio.create_task(send(client, url, model, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def run_load(url: str, model: str, prompts: list[list[int]], max_tokens: int, *, concurrency: int | None = None,
             rate: float | None = None, seed: int = 0, timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every prompt (at most ``concurrency`` in flight, or Poisson arrivals at ``rate`` req/s); returns the
    results and the wall seconds from the first send to the last answer.

    Raises:
        TimeoutError: the whole run took over ``timeout_s`` seconds.
        ValueError: neither or both of ``concurrency`` and ``rate``.
    """
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    work = (_at_concurrency(url, model, prompts, max_tokens, concurrency, timeout_s) if rate is None else
            _at_rate(url, model, prompts, max_tokens, rate, seed, timeout_s))
    start = time.perf_counter()
    results = asyncio.run(asyncio.wait_for(work, timeout_s))
    return results, time.perf_counter() - start


@dataclass(slots=True)
class Summary:
    """``vllm bench serve``'s figures for one run (ms for latencies)."""

    num_ok: int
    num_failed: int
    seconds: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    ttft_ms: tuple[float, float, float]  # p50, p95, p99
    tpot_ms: tuple[float, float, float]
    itl_ms: tuple[float, float, float] | None
    first_error: str = ""

    @property
    def total_throughput(self) -> float:
        return self.input_throughput + self.output_throughput


def percentiles_ms(values: list[float]) -> tuple[float, float, float]:
    """p50, p95, p99 in ms (numpy's linear interpolation, as vLLM's benchmark)."""
    if not values:
        return (float("nan"),) * 3
    return tuple(float(np.percentile(np.asarray(values) * 1e3, q)) for q in (50, 95, 99))


def summarize(num_prompt_tokens: list[int], num_output_tokens: list[int], ttft: list[float],
              tpot: list[float], itl: list[float] | None, seconds: float, num_failed: int = 0,
              first_error: str = "") -> Summary:
    """Throughputs over ``seconds`` (wall time of the run) and latency percentiles of the finished requests."""
    return Summary(len(ttft), num_failed, seconds, len(ttft) / seconds, sum(num_prompt_tokens) / seconds,
                   sum(num_output_tokens) / seconds, percentiles_ms(ttft), percentiles_ms(tpot),
                   None if itl is None else percentiles_ms(itl), first_error)


def summarize_results(results: list[RequestResult], seconds: float) -> Summary:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    return summarize([r.num_prompt_tokens for r in ok], [r.num_output_tokens for r in ok], [r.ttft for r in ok],
                     [r.tpot for r in ok if r.tpot is not None], [g for r in ok for g in r.itl], seconds,
                     len(failed), failed[0].error if failed else "")
