"""One pipeline object called from several threads at once (../shared/cases/pipelines-shared.md; a public report:
CogVideo #370): each call returns what it returns alone, and nothing raises."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from metainfer_gen import pipelines
from tests.pipelines.test_video_pipelines import quiet, random_image

PROMPTS = ["a red circle moving right", "a blue square moving up", "a green triangle moving left"]
CALL = dict(num_frames=17, height=32, width=32, num_inference_steps=12, seed=5)


def _together(fn, args) -> list:
    with ThreadPoolExecutor(len(args)) as pool:
        return [future.result(timeout=600) for future in [pool.submit(fn, *a) for a in args]]


def test_three_threads_on_one_video_pipeline_get_their_solo_clips(tiny_wan_dir):
    t2v = quiet(pipelines.TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu"))
    t2v.enable_step_cache("auto")
    i2v = pipelines.ImageToVideoPipeline.from_pipe(t2v)  # the same diffusers pipeline underneath
    image = random_image()
    alone = [t2v(p, **CALL).frames for p in PROMPTS] + [i2v(image, PROMPTS[0], **CALL).frames]
    calls = [(t2v, (p,)) for p in PROMPTS] + [(i2v, (image, PROMPTS[0]))]
    together = _together(lambda pipe, *args: pipe(*args, **CALL).frames, [(pipe, *args) for pipe, args in calls])
    for solo, shared in zip(alone, together):
        np.testing.assert_array_equal(shared, solo)


def test_three_threads_on_one_text_pipeline_get_their_solo_answers(text_checkpoint):
    _, _, path = text_checkpoint
    pipe = pipelines.TextGenerationPipeline.from_pretrained(path, torch_dtype=torch.float32, block_size=8)
    prompts = ["the quick brown fox", "the pass key is", "one two three"]
    alone = [pipe(p, max_new_tokens=6, ignore_eos=True).token_ids for p in prompts]
    together = _together(lambda p: pipe(p, max_new_tokens=6, ignore_eos=True).token_ids, [(p,) for p in prompts])
    assert together == alone
