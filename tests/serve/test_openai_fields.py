"""OpenAI's sampling fields on the live server through the ``openai`` client: ``n`` (sharing the prompt's KV
blocks), ``logprobs`` / ``top_logprobs`` (a log-softmax of the model's logits), a list of prompts, penalties,
``min_tokens`` and ``stop_token_ids``; and the routes tools read: ``/version``, ``/openapi.json``, ``/docs``,
``HEAD``."""

from __future__ import annotations

import pytest
import torch

from metainfer_gen.llm.sequence import SamplingParams
from tests.serve.conftest import MODEL, wait_idle

PROMPT = "The pass key is 48213. Remember it. What is the pass key? The pass key is"


def _ids(server, text: str) -> list[int]:
    return list(server.front.engine.tokenizer(text)["input_ids"])


def test_n_samples_share_the_prompt_blocks_and_reproduce_by_seed(client, server):
    wait_idle(server)
    block = server.front.engine.config.block_size
    prompt = PROMPT + " " + "and again " * 6  # a fresh prompt: nothing of it in the prefix cache yet
    num_full = len(_ids(server, prompt)) // block * block
    assert num_full >= block
    pool = server.front.engine.block_manager
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=5, n=4)

    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    # samples 1..3 read every full block of the prompt from the cache sample 0 filled
    assert out.usage.prompt_tokens_details.cached_tokens == 3 * num_full
    assert out.usage.prompt_tokens == len(_ids(server, prompt))
    singles = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=5 + j)
               for j in range(4)]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert len({c.text for c in out.choices}) > 1
    wait_idle(server)
    assert pool.num_free_blocks == pool.num_blocks


def test_logprobs_are_a_log_softmax_of_the_model_logits(client, server, offline):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    engine = offline.engine  # the same model outside the server (only the server's thread may step its engine)
    prompt_ids = _ids(server, PROMPT)
    generated = engine.generate([prompt_ids], SamplingParams(max_new_tokens=5, temperature=0))[0].token_ids
    assert len(logprobs.token_logprobs) == len(generated) == 5
    reference = _reference_logprobs(engine, prompt_ids, generated)
    for step, token in enumerate(generated):
        assert abs(logprobs.token_logprobs[step] - reference[step, token].item()) < 1e-4
        top = reference[step].topk(3)
        want = {engine.tokenizer.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        got = logprobs.top_logprobs[step]
        assert all(abs(got[text] - value) < 1e-4 for text, value in want.items())
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == out.choices[0].text


def _reference_logprobs(engine, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """(len(generated), V): log-softmax of the model's logits over the whole sequence, one full forward."""
    from metainfer_gen.llm.attention_metadata import AttentionMetadata

    tokens = prompt_ids + generated[:-1]
    blocks = list(range(-(-len(tokens) // engine.config.block_size)))
    meta = AttentionMetadata.build([0], [len(tokens)], [blocks], engine.config.block_size)
    scratch = [torch.zeros_like(cache) for cache in engine.runner.kv_caches]
    with torch.inference_mode():
        logits = engine.model.compute_logits(engine.model(torch.tensor(tokens), meta, scratch))
    return logits[len(prompt_ids) - 1:].float().log_softmax(-1)


def test_chat_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
               for entry in content)
    assert "".join(entry.token for entry in content) == out.choices[0].message.content


def test_a_list_of_prompts_gives_each_its_own_choices(client):
    prompts = [PROMPT, "Hello there", [5, 6, 7, 8]]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert len(out.choices) == 6
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert out.choices[2 * i].text == out.choices[2 * i + 1].text == alone.choices[0].text


def test_streamed_n_and_logprobs_match_the_whole_answer(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.7, seed=9, n=2, logprobs=1)
    whole = client.completions.create(**kwargs)
    texts, logprobs = ["", ""], [[], []]
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                logprobs[choice.index] += choice.logprobs.token_logprobs
    assert texts == [c.text for c in whole.choices]
    # the second request reads the prompt's blocks from the prefix cache: the same values to float32 rounding
    for streamed, c in zip(logprobs, whole.choices):
        assert streamed == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)


def test_penalties_give_the_engine_s_answer(client, server, offline):
    penalties = dict(presence_penalty=1.5, frequency_penalty=1.0)
    served = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                       extra_body={"repetition_penalty": 1.4, "ignore_eos": True}, **penalties)
    ref = offline([PROMPT], max_new_tokens=10, temperature=0, repetition_penalty=1.4, ignore_eos=True, **penalties)[0]
    plain = offline([PROMPT], max_new_tokens=10, temperature=0, ignore_eos=True)[0]
    assert served.choices[0].text == ref.text != plain.text


def test_min_tokens_holds_back_eos_and_stop_tokens(client, server, offline):
    plain = offline([PROMPT], max_new_tokens=12, temperature=0)[0]
    stop = plain.token_ids[1]
    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [stop]})
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [stop], "min_tokens": 12})
    assert short.usage.completion_tokens <= 2 and short.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 12 and held.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["/version", "/v1/models", "/health", "/openapi.json"])
def test_head_wherever_get(http, path):
    get, head = http.get(path), http.head(path)
    assert get.status_code == head.status_code == 200 and head.content == b""


def test_version_docs_and_schema(http):
    from metainfer_gen import __version__

    assert http.get("/version").json() == {"version": __version__}
    assert http.get("/docs").status_code == 200 and "swagger" in http.get("/docs").text.lower()
    schema = http.get("/openapi.json").json()
    completion = schema["paths"]["/v1/completions"]["post"]
    body = completion["requestBody"]["content"]["application/json"]["schema"]
    assert {"n", "logprobs", "min_tokens", "repetition_penalty", "stop_token_ids"} <= set(body["properties"])
    assert body["additionalProperties"] is False and "400" in completion["responses"]
    assert "head" in schema["paths"]["/v1/models"]


def test_every_bound_of_the_schema_is_accepted(http):
    """The schema's minimum and maximum of each field are answered 200 (the schema and the checks agree)."""
    schema = http.get("/openapi.json").json()["paths"]["/v1/completions"]["post"]
    properties = schema["requestBody"]["content"]["application/json"]["schema"]["properties"]
    bounds = [(name, spec[key]) for name, spec in properties.items() for key in ("minimum", "maximum") if key in spec]
    assert len(bounds) >= 15
    for name, value in bounds:
        body = {"prompt": PROMPT, "max_tokens": 1, name: value}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, (name, value, response.text)
    # JSON Schema's integers include 1.0: so do the checks
    integral = http.post("/v1/completions", json={"prompt": [5.0, 6], "max_tokens": 2.0, "n": 2.0, "seed": 3.0})
    assert integral.status_code == 200 and len(integral.json()["choices"]) == 2, integral.text


def test_schema_and_checks_agree_on_fields_that_travel_together(http):
    """A max_tokens beside max_completion_tokens is still checked; /tokenize needs a string prompt or messages."""
    messages = [{"role": "user", "content": "hi"}]
    refused = http.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2,
                                                      "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    ok = http.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2, "max_tokens": 9})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    schema = http.get("/openapi.json").json()["paths"]["/tokenize"]["post"]["requestBody"]["content"]
    body = schema["application/json"]["schema"]
    assert {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}} in body["anyOf"]
    assert http.post("/tokenize", json={"prompt": None}).status_code == 400  # null alone: neither branch
    assert http.post("/tokenize", json={"prompt": None, "messages": messages}).status_code == 200
