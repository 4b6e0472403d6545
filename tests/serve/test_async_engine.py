"""AsyncLLMEngine without HTTP: per-request streams, aborts from any thread, stop strings, refusals, close."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from metainfer_gen.llm.engine import RequestRejected
from metainfer_gen.llm.sequence import SamplingParams
from metainfer_gen.serve.async_engine import AsyncLLMEngine

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    from metainfer_gen.pipelines.text_generation import TextGenerationPipeline

    return TextGenerationPipeline.from_pretrained(num_kv_blocks=24, max_num_seqs=4).engine


@pytest.fixture
def front(engine):
    front = AsyncLLMEngine(engine)
    yield front
    front.close()
    assert not front.is_alive
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def ids(engine, text: str) -> list[int]:
    return engine.encode(text)


async def drain(stream):
    events = [event async for event in stream]
    return "".join(e.text for e in events), events[-1]


def test_streams_match_the_offline_engine(front, engine):
    prompts = ["one two", "three four five", "six", "seven eight", "nine ten", "eleven"]  # > max_num_seqs: a queue

    async def main():
        streams = [await front.add(ids(engine, p), SamplingParams(max_new_tokens=6, **GREEDY)) for p in prompts]
        return await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 30)

    results = asyncio.run(main())
    front.close()
    offline = engine.generate(prompts, SamplingParams(max_new_tokens=6, **GREEDY))
    assert [text for text, _ in results] == [o.text for o in offline]
    assert all(last.finish_reason == "length" and last.num_output_tokens == 6 for _, last in results)


def test_abort_from_another_thread_ends_the_stream_and_frees_blocks(front, engine):
    async def main():
        stream = await front.add(ids(engine, "a long story"), SamplingParams(max_new_tokens=300, **GREEDY))
        first = await asyncio.wait_for(stream.__anext__(), 10)

        def abort():
            steps_at_call.append(front.num_steps)
            front.abort(stream.request_id)

        threading.Thread(target=abort).start()
        return first, await asyncio.wait_for(drain(stream), 10)

    steps_at_call: list[int] = []
    first, (_, last) = asyncio.run(main())
    assert first.num_new_tokens == 1 and last.finished and last.finish_reason == "abort"
    assert last.num_output_tokens < 300 and front.num_open_requests == 0
    # Applied before the next step: at most the step running at the call completes (the only request: no more run).
    assert front.num_steps - steps_at_call[0] <= 1


def test_stop_string_aborts_at_the_step_that_made_it(front, engine):
    ref = engine.generate(["hello there"], SamplingParams(max_new_tokens=12, **GREEDY))[0]
    stop = ref.text[4:6]

    async def main():
        stream = await front.add(ids(engine, "hello there"), SamplingParams(max_new_tokens=12, **GREEDY), stop)
        return await asyncio.wait_for(drain(stream), 10)

    text, last = asyncio.run(main())
    assert text == ref.text[:ref.text.find(stop)] and last.finish_reason == "stop"
    assert last.num_output_tokens < 12


def test_refusals_come_back_to_the_caller(front, engine):
    async def main():
        with pytest.raises(RequestRejected, match="pool holds 384"):
            await front.add([5, 6, 7], SamplingParams(max_new_tokens=1000))
        with pytest.raises(ValueError, match=r"\[0, 512\)"):
            await front.add([5, 9999], SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="non-empty"):
            await front.add([5, 6], SamplingParams(max_new_tokens=2), stop=[""])
        stream = await front.add([5, 6], SamplingParams(max_new_tokens=2, **GREEDY))  # still serving
        return await asyncio.wait_for(drain(stream), 10)

    assert asyncio.run(main())[1].num_output_tokens == 2


def test_close_ends_open_streams(engine):
    front = AsyncLLMEngine(engine)

    async def main():
        stream = await front.add([5, 6, 7], SamplingParams(max_new_tokens=300, **GREEDY))
        await stream.__anext__()
        front.close()
        last = (await asyncio.wait_for(drain(stream), 10))[1]
        with pytest.raises(RuntimeError, match="closed"):
            await front.add([5], SamplingParams(max_new_tokens=1))
        return last

    assert asyncio.run(main()).finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not front.is_alive


def test_the_loop_can_run_on_the_calling_thread(engine):
    """``start_thread=False``: the engine steps on the thread that calls ``run_here`` (the server's main thread),
    clients on another; ``close`` from the client's thread ends the loop and frees every block."""
    front = AsyncLLMEngine(engine, start_thread=False, idle_wait_s=0.05)
    assert not front.is_alive
    prompts = ["one two", "three four five", "six"]
    results = {}

    def client():
        async def main():
            streams = [await front.add(ids(engine, p), SamplingParams(max_new_tokens=5, **GREEDY)) for p in prompts]
            return await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 30)

        try:
            results["texts"] = [text for text, _ in asyncio.run(main())]
            results["open"] = asyncio.run(_open_one(front, engine))  # left open: close must abort it
        finally:  # whatever failed, the loop below must return
            front.close(timeout_s=10)

    thread = threading.Thread(target=client)
    thread.start()
    front.run_here()  # returns once the client closes the front
    thread.join(30)
    assert not thread.is_alive() and not front.is_alive
    offline = engine.generate(prompts, SamplingParams(max_new_tokens=5, **GREEDY))
    assert results["texts"] == [o.text for o in offline]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(RuntimeError, match="start_thread=False"):
        AsyncLLMEngine(engine).run_here()


def test_run_here_stops_when_asked_and_aborts_what_is_open(engine):
    front = AsyncLLMEngine(engine, start_thread=False, idle_wait_s=0.05)
    deadline = threading.Event()
    threading.Timer(0.5, deadline.set).start()
    safety = threading.Timer(20, front.close)  # ends the loop if stop_when were ignored, so the test fails, not hangs
    safety.start()
    start = time.monotonic()
    front.run_here(stop_when=deadline.is_set)  # the server passes "uvicorn's thread has ended"
    safety.cancel()
    assert time.monotonic() - start < 10, "run_here ignored stop_when"
    assert not front.is_alive
    front.close()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


async def _open_one(front, engine):
    stream = await front.add(ids(engine, "one two three"), SamplingParams(max_new_tokens=40, **GREEDY))
    return stream.request_id
