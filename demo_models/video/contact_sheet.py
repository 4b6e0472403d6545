"""Render a contact sheet of demo-model clips: one clip per row, frames left to right, prompt above each row.

    python -m demo_models.video.contact_sheet -o docs/demo_contact_sheet.png
"""

from __future__ import annotations

import argparse

import numpy as np

SHEET_PROMPTS = (
    "a red circle moving right",
    "a green square moving up",
    "a blue triangle moving left",
    "a yellow circle moving down",
    "the purple square moves right",
    "the cyan triangle moves up",
    "a red triangle sliding down",
    "a blue circle sliding left",
)


def contact_sheet(clips: list[np.ndarray], labels: list[str], every: int = 2, scale: int = 2):
    """A ``PIL.Image``: row i shows every ``every``-th frame of ``clips[i]`` (uint8 (F, H, W, 3)), upscaled."""
    from PIL import Image, ImageDraw

    label_h, gap = 14, 2
    strips = []
    for clip in clips:
        frames = clip[::every]
        strip = np.concatenate([np.pad(f, ((0, 0), (0, gap), (0, 0)), constant_values=255) for f in frames], 1)
        strips.append(np.kron(strip, np.ones((scale, scale, 1), dtype=np.uint8)))
    width = max(s.shape[1] for s in strips)
    height = sum(s.shape[0] + label_h + gap for s in strips)
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    y = 0
    for strip, label in zip(strips, labels):
        draw.text((2, y + 1), label, fill="black")
        sheet.paste(Image.fromarray(strip), (0, y + label_h))
        y += strip.shape[0] + label_h + gap
    return sheet


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="docs/demo_contact_sheet.png", help="PNG to write")
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first clip; row i uses seed + i")
    args = parser.parse_args(argv)

    from metainfer_gen import pipelines

    pipe = pipelines.TextToVideoPipeline.from_pretrained(args.model, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    clips = [pipe(p, seed=args.seed + i).frames for i, p in enumerate(SHEET_PROMPTS)]
    contact_sheet(clips, list(SHEET_PROMPTS)).save(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
