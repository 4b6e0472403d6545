"""Invalid text and malformed bodies on the LLM routes (issue 31, class 2): lone surrogates and invalid UTF-8 in
any text field, JSON nested past the bound, integers past any range, token ids outside the vocabulary, query
strings on POST routes: each a 400 in OpenAI's error JSON naming the field, nothing queued, and the server keeps
serving. An unexpected exception answers a 500 with a request id and no internal text."""

from __future__ import annotations

import json
import time

import pytest

from tests.serve.conftest import MODEL, free_blocks, wait_idle
from tests.serve.test_errors import check_error, check_next_good

JSON = {"content-type": "application/json"}
SURROGATE = "\ud800"
CHAT = {"model": MODEL, "max_tokens": 2}


# (route, body with a lone surrogate written as JSON's escape, the field the 400 must name)
SURROGATE_CASES = [
    ("/v1/completions", {"model": MODEL, "prompt": f"hi {SURROGATE}"}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["ok", f"a{SURROGATE}"]}, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["x", SURROGATE]}, "stop[1]"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": f"x{SURROGATE}y"}]}]}, "messages[0].content[0].text"),
    ("/tokenize", {"model": MODEL, "prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    ("/detokenize", {"model": SURROGATE, "tokens": [1]}, "model"),
]


def test_lone_surrogates_in_any_text_field_are_a_400_naming_it(server, http):
    for route, body, param in SURROGATE_CASES:
        raw = json.dumps(body).encode()  # json.dumps writes the lone surrogate as the escape "\ud800"
        assert b"\\ud800" in raw
        check_error(http.post(route, content=raw, headers=JSON), 400, param, "lone surrogate")
    check_error(http.post("/v1/completions", content=b'{"prompt": "x", "\\udc00": 1}', headers=JSON), 400,
                "'\\udc00'", "field name")
    wait_idle(server)
    assert free_blocks(server)[0] == free_blocks(server)[1]
    check_next_good(http)


def test_invalid_utf8_bytes_are_a_400_naming_the_field(http):
    for route, raw, param in [
        ("/v1/completions", b'{"model": "demo_llm", "prompt": "caf\xe9 au lait"}', "prompt"),
        ("/v1/chat/completions", b'{"max_tokens": 2, "messages": [{"role": "user", "content": "\xff\xfe"}]}',
         "messages[0].content"),
        ("/tokenize", b'{"prompt": "ok \xc3"}', "prompt"),
    ]:
        check_error(http.post(route, content=raw, headers=JSON), 400, param, "invalid UTF-8")
    check_next_good(http)


def test_deep_nesting_and_huge_integers_are_a_400(http):
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        check_error(http.post(route, content=deep, headers=JSON), 400, None, "nested too deeply")
        shallow_but_past_bound = b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}"
        check_error(http.post(route, content=shallow_but_past_bound, headers=JSON), 400, "prompt",
                    "nested too deeply")
        huge = b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
        check_error(http.post(route, content=huge, headers=JSON), 400, None, "thousands of digits")
    check_next_good(http)


@pytest.mark.parametrize("stop_ids", [[2**70], [10**6], [2**63]])
def test_stop_token_ids_outside_the_vocabulary_are_a_400_before_queueing(server, http, stop_ids):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": stop_ids}
    check_error(http.post("/v1/completions", json=body), 400, "stop_token_ids", "token ids in [0,")
    wait_idle(server)
    check_next_good(http)


def test_a_query_string_on_a_post_route_is_refused_by_name(http):
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        check_error(http.post(route + "?stream=true", json={"model": MODEL, "prompt": "x"}), 400, "stream",
                    "query parameter 'stream'")
    check_next_good(http)


def test_an_unexpected_exception_answers_a_request_id_and_no_internal_text(http, monkeypatch, caplog):
    from metainfer_gen.serve import app as app_module

    def broken(*_):
        raise OSError("disk gone at /srv/secret/tokenizer.json")

    monkeypatch.setattr(app_module, "chat_token_ids", broken)
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "internal_server_error" and "OSError" in error["message"]
    assert "secret" not in r.text and "disk gone" not in r.text
    request_id = r.headers["x-request-id"]
    assert request_id in error["message"]
    assert any(request_id in record.getMessage() for record in caplog.records)
    monkeypatch.undo()
    check_next_good(http)


def test_a_client_gone_before_its_body_arrived_logs_one_line(server, http, caplog):
    """A client that sends half a body and closes gets nothing (it is gone) and costs one info line, never a
    traceback per connection (a flood of them was one client's doing)."""
    import logging
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(server.base_url)
    caplog.set_level(logging.INFO, logger="metainfer_gen")
    for _ in range(3):
        with socket.create_connection((where.hostname, where.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"mod")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum("disconnected before its body" in r.getMessage()
                                              for r in caplog.records) < 3:
        time.sleep(0.05)
    gone = [r for r in caplog.records if "disconnected before its body" in r.getMessage()]
    assert len(gone) == 3 and all(r.levelno == logging.INFO and r.exc_info is None for r in gone)
    assert not any(r.exc_info and "ClientDisconnect" in repr(r.exc_info[1].__class__) for r in caplog.records)
    check_next_good(http)
