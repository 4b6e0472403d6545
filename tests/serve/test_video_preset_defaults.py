"""A server whose workers run an acceleration preset renders at the preset's call defaults: the step count and
guidance a worker reports (``fastest``: its step LoRA's 4 unguided steps) win over the model's settings file, which
the API process reads before any worker has loaded the model (20 steps, guidance 4 for the embedded model)."""

from __future__ import annotations

from metainfer_gen.serve.video.service import VideoService, VideoServeConfig
from tests.serve.video_helpers import small_limits


def test_the_defaults_a_worker_reports_win_over_the_settings_file(tmp_path):
    service = VideoService.start(VideoServeConfig(data_dir=tmp_path, limits=small_limits(), num_workers=0))
    try:
        assert service.checks.defaults["num_inference_steps"] == 20  # the embedded model's metainfer_gen.json
        service.store.set_meta("defaults", {"num_inference_steps": 4, "guidance_scale": 1.0, "num_frames": 17})
        service.store.set_meta("rules", {"family": "WanPipeline", "temporal_factor": 4, "spatial_multiple": 16,
                                         "max_size": 8192, "max_frames": 4093})
        job = service.submit({"prompt": "a red circle moving right", "seed": 1})
        assert (job.request["num_inference_steps"], job.request["guidance_scale"]) == (4, 1.0)
        asked = service.submit({"prompt": "a red circle moving right", "seed": 1, "num_inference_steps": 6})
        assert asked.request["num_inference_steps"] == 6  # a request's own value still wins
    finally:
        service.close()
