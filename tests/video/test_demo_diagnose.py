"""The direction diagnostic's pure parts: object centroids in latents and prompt word swaps."""

import math

import torch

from demo_models.video.diagnose import latent_centroids, swapped_prompts


def test_latent_centroids_follow_a_moving_blob():
    latents = torch.zeros(1, 4, 3, 16, 16)
    for k, x in enumerate((3, 7, 11)):
        latents[0, :, k, 5:8, x - 1:x + 2] = 2.0  # 3x3 blob centred at (x, 6)
    centroids = latent_centroids(latents)
    assert centroids.shape == (1, 3, 2)
    assert torch.allclose(centroids[0], torch.tensor([[3.0, 6.0], [7.0, 6.0], [11.0, 6.0]]))


def test_latent_centroids_empty_frame_is_nan():
    latents = torch.zeros(1, 2, 1, 8, 8)
    assert math.isnan(latent_centroids(latents)[0, 0, 0].item())


def test_swapped_prompts_change_only_the_named_word():
    combos = [("red", "circle", "left")]
    assert swapped_prompts(combos, None) == ["a red circle moving left"]
    assert swapped_prompts(combos, "direction") == ["a red circle moving up"]
    assert swapped_prompts(combos, "colour") == ["a green circle moving left"]
    assert swapped_prompts(combos, "shape") == ["a red square moving left"]
    assert swapped_prompts(combos, "empty") == [""]
