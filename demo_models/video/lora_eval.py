"""Measured effects of the demo LoRAs, read from decoded frames with :mod:`.evaluate`'s clip reader.

* prompt adherence: on held-out (colour, shape, direction) prompts, the share of clips whose object has the
  prompted colour and the share moving the prompted way; the score is their mean, in points (0-100);
* background colour: the median border colour (``evaluate.foreground_masks``), averaged over frames and clips;
* fidelity: PSNR/SSIM of a clip against a reference clip of the same prompt and seed.
"""

from __future__ import annotations

import numpy as np

from demo_models.video.data import TEMPLATES, held_out_combinations
from demo_models.video.evaluate import foreground_masks, read_clip


def held_out_prompts(limit: int | None = None) -> list[tuple[str, tuple[str, str, str]]]:
    """``[(prompt, (colour, shape, direction)), ...]`` over the held-out triples, templates rotating."""
    combos = held_out_combinations()[:limit]
    return [(TEMPLATES[i % len(TEMPLATES)].format(colour=c, shape=s, direction=d), (c, s, d))
            for i, (c, s, d) in enumerate(combos)]


def render(pipe, prompts, seed: int = 0, **call) -> list[np.ndarray]:
    """One uint8 clip (F, H, W, 3) per prompt; prompt i uses seed ``seed + i``."""
    return [pipe(prompt, seed=seed + i, **call).frames for i, (prompt, _) in enumerate(prompts)]


def adherence(clips: list[np.ndarray], prompts) -> dict[str, float]:
    """colour_accuracy and direction_accuracy in [0, 1], and score = 100 x their mean."""
    readings = [read_clip(clip) for clip in clips]
    colour = float(np.mean([r.colour == combo[0] for r, (_, combo) in zip(readings, prompts)]))
    direction = float(np.mean([r.direction == combo[2] for r, (_, combo) in zip(readings, prompts)]))
    return {"colour_accuracy": colour, "direction_accuracy": direction, "score": 100 * (colour + direction) / 2}


def background_colour(clips: list[np.ndarray]) -> np.ndarray:
    """Mean over clips and frames of the border-estimated background, RGB float64 in [0, 1]."""
    return np.mean([foreground_masks(clip)[1].mean(axis=0) for clip in clips], axis=0)


def fidelity(clips: list[np.ndarray], references: list[np.ndarray]) -> dict[str, float]:
    """Mean PSNR (dB) and SSIM of ``clips`` against ``references`` (same order)."""
    from metainfer_gen.video.quality import psnr, ssim

    return {"psnr": float(np.mean([psnr(c, r) for c, r in zip(clips, references)])),
            "ssim": float(np.mean([ssim(c, r) for c, r in zip(clips, references)]))}
