"""``metainfer-gen serve`` as a real process: loopback by default, the API key, a clean stop on SIGTERM."""

from __future__ import annotations

import importlib.util
import re
import time

import httpx
import openai
import pytest

from metainfer_gen.apps.cli import main
from tests.serve.conftest import MODEL
from tests.serve.processes import start_serve, stop_process


@pytest.fixture
def cli_server():
    """(process, base URL, lines printed before the URL) of ``serve --port 0 --api-key secret``; terminated at
    teardown."""
    proc, url, lines = start_serve(["--port", "0", "--api-key", "secret", "--video", "none", "--num-kv-blocks", "64",
                                    "--max-num-seqs", "8", "--log-level", "warning"])
    try:
        yield proc, url, lines
    finally:
        stop_process(proc, 15, 5)


def test_cli_serves_on_loopback_with_an_api_key(cli_server):
    proc, url, lines = cli_server
    assert url.startswith("http://127.0.0.1:")
    # a user waiting on start-up is told what runs and, after, what it took
    assert any(line.startswith("loading the embedded LLM and warming up") for line in lines), lines
    assert any(re.fullmatch(r"warmed up in \d+ s: \d+ prefill and \d+ decode step shapes, \d+ graphs compiled"
                            r"(; decode steps run eager: .+)?\n", line) for line in lines), lines
    for headers, words in (({}, "missing API key"), ({"authorization": "Bearer wrong"}, "incorrect API key"),
                           ({"authorization": "Basic secret"}, "missing API key")):
        r = httpx.post(url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401 and words in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200  # probes need no key
    with openai.OpenAI(base_url=url, api_key="secret", max_retries=0, timeout=30) as client:
        out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens >= 1 and out.model == MODEL
        assert [m.id for m in client.models.list().data] == [MODEL]
    proc.terminate()
    # uvicorn shuts down gracefully, then re-raises the signal it caught: the exit status is SIGTERM's
    assert proc.wait(15) in (0, -15)


def test_cli_names_the_extra_when_uvicorn_is_missing(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "uvicorn" in err and "pip install 'metainfer-gen[serve]'" in err


def test_cli_rejects_bad_flags_before_loading(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--port", "70000"])
    assert "[0, 65535]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--max-num-seqs", "0"])
    assert main(["serve", "--api-key", " ", "--port", "0"]) == 2
    assert "api_key" in capsys.readouterr().err


def test_vllm_flag_names_and_a_positional_model_reach_the_engine(monkeypatch, tmp_path):
    from contextlib import contextmanager

    seen = {}

    @contextmanager
    def no_load(tp, llm, **options):  # record what would be loaded, load nothing
        seen.update(tp=tp, llm=llm, **options)
        yield None

    monkeypatch.setattr("metainfer_gen.apps.tp_launch.tensor_parallel_pipeline", no_load)
    assert main(["serve", str(tmp_path), "--port", "0", "--video", "none", "--tensor-parallel-size", "1",
                 "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                 "--served-model-name", "ds", "--dtype", "auto", "--kv-cache-dtype", "fp8",
                 "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching"]) == 0
    assert seen == {"tp": 1, "llm": str(tmp_path), "max_model_len": 512, "max_num_seqs": 8,
                    "max_num_batched_tokens": 256, "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.5,
                    "enable_prefix_caching": False}


def test_positional_model_and_llm_must_agree(capsys):
    assert main(["serve", "a", "--llm", "b", "--port", "0", "--video", "none"]) == 2
    assert "disagree" in capsys.readouterr().err
    assert main(["serve", "--gpu-memory-utilization", "1.5", "--port", "0", "--video", "none"]) == 2
    assert "(0, 1]" in capsys.readouterr().err


def test_run_forever_serves_from_the_main_thread_until_stop_when():
    """What ``metainfer-gen serve`` runs (the engine loop on this thread, uvicorn on another) answers a real client
    with the offline engine's greedy text, returns once ``stop_when()`` is true and frees its port."""
    import threading

    from metainfer_gen.pipelines.text_generation import TextGenerationPipeline
    from metainfer_gen.serve.server import LLMServer, ServeConfig, bind_socket
    from tests.serve.postgres_cluster import free_port

    pipe = TextGenerationPipeline.from_pretrained(num_kv_blocks=64)
    ref = pipe("The quick brown fox", max_new_tokens=6, temperature=0)
    port = free_port()
    answers, deadline = [], time.monotonic() + 120

    def ask():
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30) as c:
            while time.monotonic() < deadline:
                try:
                    answers.append(c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6,
                                                        temperature=0).choices[0].text)
                    return
                except openai.APIConnectionError:  # not listening yet
                    time.sleep(0.2)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    LLMServer.run_forever(ServeConfig(port=port), log_level="warning", pipe=pipe,
                          stop_when=lambda: bool(answers) or time.monotonic() > deadline)
    asker.join(30)
    assert answers == [ref.text]
    bind_socket("127.0.0.1", port).close()  # closed: the port is free again
