"""The OpenAI routes through the real ``openai`` client: streamed == whole == the offline engine's greedy text."""

from __future__ import annotations

from metainfer_gen.llm.detokenizer import REPLACEMENT
from metainfer_gen.serve.chat import render_chat
from tests.serve.conftest import MODEL, free_blocks, metric, wait_idle

PROMPTS = ["The capital of France is", "Hello world, 你好 🙂 and", "def fibonacci(n):"]


def _stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def test_completions_streamed_equals_whole_equals_offline(client, offline):
    for prompt in PROMPTS:
        ref = offline(prompt, max_new_tokens=12, temperature=0)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        text, chunks = _stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                              temperature=0, stream=True))
        assert whole.choices[0].text == text == ref.text, prompt
        assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == ref.finish_reason.value
        usage = whole.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_chat_streamed_equals_whole_equals_offline(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour: 红"}]
    prompt_ids = offline.tokenizer(render_chat(offline.tokenizer, messages), add_special_tokens=False)["input_ids"]
    ref = offline([prompt_ids], max_new_tokens=10, temperature=0)[0]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == text == ref.text
    assert whole.choices[0].message.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(prompt_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_spanning_two_tokens(client, offline, server):
    prompt = "The capital of France is"
    ref = offline(prompt, max_new_tokens=24, temperature=0)
    pieces = [offline.tokenizer.decode([t]) for t in ref.token_ids]
    # The first place two neighbouring tokens both show text: a stop string made of the end of one and the start
    # of the next can only match across the token boundary.
    i = next(i for i in range(2, len(pieces) - 1) if pieces[i].strip() and pieces[i + 1].strip()
             and (pieces[i][-1] + pieces[i + 1][0]) not in "".join(pieces[:i]) + pieces[i][:-1])
    stop = pieces[i][-1] + pieces[i + 1][0]
    expected = ref.text[:ref.text.find(stop)]
    for stops in (stop, [stop, "never appears"]):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stops)
        text, chunks = _stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                              temperature=0, stop=stops, stream=True))
        assert whole.choices[0].text == text == expected
        assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
        assert not any(text.endswith(stop[:n]) for n in range(1, len(stop) + 1))
        assert whole.usage.completion_tokens == i + 2  # generation stopped at the token completing the stop string
    wait_idle(server)
    assert free_blocks(server)[0] == free_blocks(server)[1]


def test_prompt_ids_ending_inside_a_character(client, offline):
    tok = offline.tokenizer
    ids = tok("Emoji time 🙂👍 then")["input_ids"]
    cut = next(c for c in range(len(ids) - 1, 0, -1) if tok.decode(ids[:c]).endswith(REPLACEMENT))
    prompt = ids[:cut]  # ends part-way through an emoji's four bytes
    ref = offline([prompt], max_new_tokens=8, temperature=0, ignore_eos=True)[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    text, _ = _stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True}))
    # The completion is the whole text from where it first differs from the prompt's own text: a character the
    # model completes comes out whole; bytes the prompt left dangling that the model did not complete stay the
    # prompt's (its U+FFFD), never the completion's.
    prompt_text = tok.decode(prompt, skip_special_tokens=True)
    full = tok.decode(prompt + ref.token_ids, skip_special_tokens=True)
    common = next((i for i, (a, b) in enumerate(zip(prompt_text, full)) if a != b), len(prompt_text))
    assert whole.choices[0].text == text == full[common:]
    assert REPLACEMENT not in text and prompt_text.endswith(REPLACEMENT)


def test_sampling_with_seed_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                  extra_body={"top_k": 50})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
    streamed, _ = _stream_text(client.completions.create(stream=True, **kwargs))
    assert streamed == first


def test_models_health_tokenize_detokenize(client, http, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert http.get("/health").json() == {"status": "ok"}
    tok = http.post("/tokenize", json={"prompt": "你好 🙂"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == server.front.engine.max_model_len
    assert http.post("/detokenize", json={"tokens": tok["tokens"][1:]}).json() == {"prompt": "你好 🙂"}
    bare = http.post("/tokenize", json={"prompt": "你好 🙂", "add_special_tokens": False}).json()
    assert bare["tokens"] == tok["tokens"][1:]  # without BOS
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


def test_metrics_count_tokens_and_latencies(client, http, server):
    num_prompt = http.post("/tokenize", json={"prompt": "a " * 40}).json()["count"]
    before = http.get("/metrics").text
    client.completions.create(model=MODEL, prompt="a " * 40, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    client.completions.create(model=MODEL, prompt="a " * 40, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})  # same prompt: its full blocks come from the cache
    wait_idle(server)
    after = http.get("/metrics").text
    delta = {name: metric(after, name) - metric(before, name) for name in (
        "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total", "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count")}
    assert delta["vllm:generation_tokens_total"] == 10 and delta["vllm:prompt_tokens_total"] == 2 * num_prompt
    # In tokens of whole 16-token blocks: the first request looks up its first block and misses, the second finds
    # both full blocks before its last token.
    assert delta["vllm:prefix_cache_hits_total"] == 32 and delta["vllm:prefix_cache_queries_total"] == 48
    assert delta["vllm:time_to_first_token_seconds_count"] == 2 and delta["vllm:inter_token_latency_seconds_count"] == 8
    assert delta["vllm:e2e_request_latency_seconds_count"] == 2
    assert metric(after, "vllm:num_requests_running") == 0 and metric(after, "vllm:kv_cache_usage_perc") == 0
