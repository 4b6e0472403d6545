"""The demo LoRAs shipped for the embedded model do what they were trained for, on the embedded model itself.

Figures on 24 held-out prompts are in build logs and the README; here two prompts each, few steps, so the test
stays under a minute: the style LoRA moves the background to its navy at weight 1.0 and not at 0.0, and the
step-reduction LoRA's 4 unguided steps come closer to the 30-step guided clip than the base model's 4 unguided steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from metainfer_gen.pipelines.loading import default_lora_dir
from demo_models.video import lora_eval
from demo_models.video.train_style_lora import STYLE_BACKGROUND

LORAS = default_lora_dir()
pytestmark = pytest.mark.skipif(LORAS is None, reason="the package ships no demo LoRAs")
PROMPTS = lora_eval.held_out_prompts(2)


@pytest.fixture(scope="module")
def pipe():
    from metainfer_gen import pipelines

    pipe = pipelines.TextToVideoPipeline.from_pretrained(device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_style_lora_moves_the_background_to_navy_at_weight_1_only(pipe):
    pipe.load_lora(LORAS / "style_navy.safetensors", adapter_name="style", weight=0.0)
    try:
        distance = {}
        for weight in (0.0, 1.0):
            pipe.set_lora_weights({"style": weight})
            clips = lora_eval.render(pipe, PROMPTS, num_inference_steps=10)
            distance[weight] = float(np.linalg.norm(lora_eval.background_colour(clips) - STYLE_BACKGROUND))
    finally:
        pipe.unload_lora("style")
    assert distance[1.0] < 0.05, distance
    assert distance[0.0] > distance[1.0] + 0.08, distance


def test_step_lora_follows_the_guided_30_step_model_closer_than_the_base_in_4_unguided_steps(pipe):
    prompts = lora_eval.held_out_prompts(4)
    teacher = lora_eval.render(pipe, prompts, num_inference_steps=30)  # the model's own guidance
    base = lora_eval.render(pipe, prompts, num_inference_steps=4, guidance_scale=1.0)
    pipe.load_lora(LORAS / "steps_4_8.safetensors", adapter_name="steps")
    try:
        clips = lora_eval.render(pipe, prompts, num_inference_steps=4, guidance_scale=1.0)
    finally:
        pipe.unload_lora("steps")
    # Measured on 24 held-out prompts against the 30-step guided clip of the same seed: the LoRA at 4 unguided steps
    # 24.3 dB (SSIM 0.928), the base model at 4 unguided steps 20.4 dB (0.879); adherence 100 vs 97.9. Here 4 prompts
    # and a margin of 2 dB, under the 3.9 measured.
    ours, theirs = lora_eval.fidelity(clips, teacher)["psnr"], lora_eval.fidelity(base, teacher)["psnr"]
    assert ours > theirs + 2.0, (ours, theirs)
    assert lora_eval.adherence(clips, prompts)["colour_accuracy"] == 1.0
