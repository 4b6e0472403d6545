"""Shared by the ``/v1/videos`` tests: bounded waits on jobs, and the limits the test servers use."""

from __future__ import annotations

import time

FINISHED = ("completed", "failed", "cancelled")
JOB_TIMEOUT_S = 120  # a tiny clip takes well under a second; start-up of the workers (imports, load) dominates
SHORT = {"num_frames": 5, "size": "32x32", "num_inference_steps": 2, "guidance_scale": 1.0}
# Long enough (a few seconds on one thread) to be seen running and to be cancelled or killed mid-way.
LONG = {"num_frames": 33, "size": "64x64", "num_inference_steps": 50, "guidance_scale": 5.0}


def small_limits():
    """The demo's limits as the tests' servers use them (64 px, 33 frames, 50 steps)."""
    from metainfer_gen.apps.demo_limits import DemoLimits

    return DemoLimits(max_frames=33, max_size=64, max_steps=50)



def wait_for(http, video_id: str, statuses=FINISHED, timeout_s: float = JOB_TIMEOUT_S, min_progress: int = 0
             ) -> dict:
    """Poll ``GET /v1/videos/{id}`` until its status is in ``statuses`` (and progress >= ``min_progress``).

    Raises:
        TimeoutError: not within ``timeout_s`` seconds (the message has the last answer).
    """
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = http.get(f"/v1/videos/{video_id}").json()
        if last.get("status") in statuses and last.get("progress", 0) >= min_progress:
            return last
        time.sleep(0.05)
    raise TimeoutError(f"video {video_id} not in {statuses} within {timeout_s} s: {last}")
