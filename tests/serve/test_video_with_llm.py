"""The LLM and the video model on one app: one port, one API key, one ``/health`` and one ``/metrics``; and
``serve`` with no model flags picks both embedded models."""

from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL, metric
from tests.serve.video_helpers import SHORT, small_limits, wait_for


@pytest.fixture(scope="module")
def both(tiny_wan_dir, tmp_path_factory):
    from metainfer_gen.serve.server import LLMServer, ServeConfig
    from metainfer_gen.serve.video.service import VideoServeConfig

    video = VideoServeConfig(data_dir=tmp_path_factory.mktemp("both"), limits=small_limits(), model=tiny_wan_dir,
                             num_workers=1, num_threads=1, device="cpu")
    server = LLMServer.start(ServeConfig(port=0, api_key="secret", engine={"num_kv_blocks": 64}, video=video))
    yield server
    server.close()


def test_one_port_one_key_one_metrics(both):
    import httpx

    with httpx.Client(base_url=both.base_url.removesuffix("/v1"), timeout=60) as http:
        assert http.post("/v1/videos", json={"prompt": "x", **SHORT}).status_code == 401  # the same key guards both
        assert http.get("/v1/videos").status_code == 401
        key = {"authorization": "Bearer secret"}
        http.headers.update(key)
        video_id = http.post("/v1/videos", json={"prompt": "a red circle", **SHORT}).json()["id"]
        completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] >= 1
        assert wait_for(http, video_id)["status"] == "completed"
        assert http.get("/health").json() == {"status": "ok"}
        text = http.get("/metrics").text
        assert metric(text, "vllm:request_success_total") >= 1
        assert metric(text, "metainfer:video_clip_seconds_count") == 1
        assert metric(text, "metainfer:video_workers_alive") == 1


def test_serve_without_model_flags_serves_both_embedded_models():
    from metainfer_gen.apps.cli import build_parser
    from metainfer_gen.apps.video_serve_args import video_serve_config
    from metainfer_gen.pipelines.loading import default_lora_dir

    args = build_parser().parse_args(["serve"])
    assert args.llm is None  # the embedded LLM
    config = video_serve_config(args)
    assert config is not None and config.model is None and config.num_workers == 1
    if default_lora_dir() is not None:
        assert config.lora("style_navy.safetensors", 0.5)[1] == 0.5  # the embedded LoRAs, by name
    assert video_serve_config(build_parser().parse_args(["serve", "--video", "none"])) is None


def test_models_lists_both_kinds_and_the_schema_covers_both(both):
    import httpx

    with httpx.Client(base_url=both.base_url.removesuffix("/v1"), timeout=60,
                      headers={"authorization": "Bearer secret"}) as http:
        models = http.get("/v1/models").json()["data"]
        assert {(m["id"], m["kind"]) for m in models} == {(MODEL, "llm"), (both.video.model_name, "video")}
        assert http.head("/v1/videos").status_code == 200 and http.head("/v1/videos").content == b""
        paths = http.get("/openapi.json").json()["paths"]
        body = paths["/v1/videos"]["post"]["requestBody"]["content"]
        assert {"application/json", "multipart/form-data"} <= set(body)
        form = body["multipart/form-data"]["schema"]["properties"]  # typed as in JSON: "w" is no num_frames
        assert form["num_frames"]["type"] == "integer" and form["input_reference"]["format"] == "binary"
        assert "video/mp4" in paths["/v1/videos/{video_id}/content"]["get"]["responses"]["200"]["content"]
        assert http.get("/v1/videos", params={"limit": "x"}).json()["error"]["param"] == "limit"
        refused = http.put("/v1/videos")  # 405 names every method of the path, not only the first route's
        assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD, POST"
