"""The two roles of a fleet node, on one shared PostgreSQL store: ``serve --video-workers 0`` answers the API and
renders nothing; ``metainfer-gen video-worker`` renders and serves no HTTP. A job submitted to the first is rendered
by the second, and the first answers its status and content."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.serve.processes import stop_process
from tests.serve.video_helpers import SHORT, small_limits, wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_an_api_only_node_and_a_worker_only_node_share_the_queue(tiny_wan_dir, tmp_path, postgres_url):
    import httpx

    from metainfer_gen.serve.server import LLMServer, ServeConfig
    from metainfer_gen.serve.video.service import VideoServeConfig

    clips = tmp_path / "shared"
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([sys.executable, "-m", "metainfer_gen.apps.cli", "video-worker", "--job-store",
                               postgres_url, "--clips-dir", str(clips), "--video", str(tiny_wan_dir), "--threads", "1",
                               "--video-device", "cpu"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                              stdout=log, stderr=subprocess.STDOUT)
    log.close()
    video = VideoServeConfig(data_dir=tmp_path / "api", limits=small_limits(), model=tiny_wan_dir, num_workers=0,
                             job_store=postgres_url, clips_dir=clips)
    server = LLMServer.start(ServeConfig(port=0, with_llm=False, video=video))
    try:
        with httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=30) as http:
            assert http.get("/health").status_code == 200 and server.video.num_alive_workers == 0
            video_id = http.post("/v1/videos", json={"prompt": "rendered elsewhere", **SHORT, "seed": 3}).json()["id"]
            assert wait_for(http, video_id)["status"] == "completed"
            content = http.get(f"/v1/videos/{video_id}/content")
            assert content.status_code == 200 and content.content == (clips / f"{video_id}.mp4").read_bytes()
        job = server.video.store.get(video_id)
        assert job.renders == 1 and job.owner.split("-")[-1].startswith(f"{worker.pid}/")
    finally:
        server.close()
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        finally:
            stop_process(worker)
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()[-2000:]
