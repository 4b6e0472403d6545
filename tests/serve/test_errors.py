"""Every bad request gets its 4xx in OpenAI's error JSON, naming what was wrong, and the next good request works."""

from __future__ import annotations

import json

import openai
import pytest

from tests.serve.conftest import MODEL, NUM_KV_BLOCKS, free_blocks, wait_idle

JSON = {"content-type": "application/json"}
GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def check_error(response, status: int, param: str | None, words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words.lower() in error["message"].lower(), error
    return error


def check_next_good(http) -> None:
    good = http.post("/v1/completions", json=GOOD)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("body, headers, words", [
    (b"[]", JSON, "got an array"), (b"null", JSON, "got null"), (b"123", JSON, "got a number"),
    (b'"s"', JSON, "got a string"), (b"{bad json", JSON, "malformed JSON"), (b"", JSON, "empty request body"),
    (json.dumps(GOOD).encode(), {}, "missing Content-Type"),
    (json.dumps(GOOD).encode(), {"content-type": "text/plain"}, "is not JSON"),
])
def test_bad_bodies(http, body, headers, words):
    for route in ("/v1/completions", "/v1/chat/completions"):
        check_error(http.post(route, content=body, headers=headers), 400, None, words)
    check_next_good(http)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
])
def test_nan_is_refused_by_name(http, route, body):
    check_error(http.post(route, content=body, headers=JSON), 400, "temperature", "finite number")
    check_next_good(http)


def test_a_field_of_the_other_endpoint_is_unknown_here(http):
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    check_error(http.post("/v1/completions", json=body), 400, "messages", "unknown field 'messages'")
    check_error(http.post("/v1/chat/completions", json=body), 400, "prompt", "unknown field 'prompt'")
    check_next_good(http)


@pytest.mark.parametrize("field, value, words", [
    ("temperature", "NaN", "finite number"), ("temperature", -1, ">= 0"), ("top_p", 0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"), ("max_tokens", 0, ">= 1"), ("max_tokens", -3, ">= 1"), ("max_tokens", "8", ">= 1"),
    ("n", 0, "[1, 16]"), ("n", 17, "[1, 16]"), ("model", "gpt-4o", "does not exist"), ("stop", "", "non-empty"),
    ("top_k", -2, "top_k"), ("seed", 1.5, "integer"), ("seed", 2**70, "64-bit"), ("logprobs", 21, "[0, 20]"),
    ("stream_options", {"include_usage": True}, "only with stream"), ("prompt", "   ", "empty"),
    ("prompt", [], "non-empty"), ("prompt", [1.5], "non-empty"), ("ignore_eos", "yes", "true or"),
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3, "[-2, 2]"),
    ("repetition_penalty", 0, "(0, 100]"), ("min_tokens", 3, "must not exceed max_tokens"),
    ("min_tokens", -1, ">= 0"), ("echo", True, "not supported"), ("best_of", 3, "not supported"),
    ("max_token", 3, "unknown field 'max_token'"), ("stop_token_ids", [-1], "list of token ids"),
    ("stop_token_ids", {}, "list of token ids"),
    ("user", {}, "must be a string or null"),
])
def test_bad_fields(client, http, field, value, words):
    # vLLM's extras and unknown fields travel in extra_body (the openai client has no argument for them)
    extra = field in ("top_k", "ignore_eos", "repetition_penalty", "min_tokens", "max_token", "stop_token_ids")
    body = dict(GOOD, extra_body={field: value}) if extra else dict(GOOD, **{field: value})
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**body)
    error = err.value.body
    assert err.value.status_code == 400 and error["param"] == field and words in error["message"], error
    check_next_good(http)


@pytest.mark.parametrize("messages, param", [
    ([], "messages"), ([{"role": "robot", "content": "hi"}], "messages[0].role"), (["hi"], "messages[0]"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
])
def test_bad_chat_messages(client, http, messages, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert err.value.body["param"] == param
    check_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages", "missing required")
    check_next_good(http)


def test_prompt_too_long_for_the_context(http, server):
    max_len = server.front.engine.max_model_len
    error = check_error(http.post("/v1/completions", json=dict(GOOD, prompt="1" * (max_len + 100))), 400,
                        "prompt", "maximum context length")
    assert str(max_len) in error["message"] and error["code"] == "context_length_exceeded"
    error = check_error(http.post("/v1/completions", json=dict(GOOD, max_tokens=max_len)), 400, "max_tokens",
                        "maximum context length")
    assert str(max_len) in error["message"]
    check_next_good(http)


def test_prompt_too_large_for_the_kv_pool(http, server):
    capacity = NUM_KV_BLOCKS * 16
    max_tokens = capacity + 20  # within the 2048-token context, beyond the pool
    assert max_tokens < server.front.engine.max_model_len - 10
    error = check_error(http.post("/v1/completions", json=dict(GOOD, max_tokens=max_tokens)), 400, "prompt",
                        "KV cache")
    assert f"pool holds {capacity}" in error["message"] and str(max_tokens) in error["message"]
    check_error(http.post("/v1/completions", json=dict(GOOD, prompt=[5, 100000])), 400, "prompt", "[0, 512)")
    check_error(http.post("/v1/completions", json=dict(GOOD, prompt=[-3])), 400, "prompt", "[0, 512)")
    check_error(http.post("/v1/completions", json=dict(GOOD, prompt=["a", [7, -1]])), 400, "prompt[1]", "[0, 512)")
    wait_idle(server)
    assert free_blocks(server)[0] == free_blocks(server)[1]
    check_next_good(http)


def test_body_over_the_limit_is_413(http):
    big = json.dumps(dict(GOOD, prompt="a" * (1 << 20))).encode()
    error = http.post("/v1/completions", content=big, headers=JSON)
    assert error.status_code == 413 and "limit of 1048576 bytes" in error.json()["error"]["message"]

    def chunks():  # no Content-Length: the server counts while reading
        yield big[:1 << 19]
        yield big[1 << 19:]

    chunked = http.post("/v1/completions", content=chunks(), headers=JSON)
    assert chunked.status_code == 413 and "more than" in chunked.json()["error"]["message"]
    check_next_good(http)


def test_unknown_routes_and_methods(http):
    check_error(http.get("/v1/nothing"), 404, None, "not found")
    check_error(http.get("/v1/completions"), 405, None, "method not allowed")
    check_error(http.post("/detokenize", json={"tokens": [1, 9999]}), 400, "tokens", "[0, 512)")
    check_error(http.post("/tokenize", json={}), 400, "prompt", "give 'prompt'")
    check_next_good(http)
