"""Prompt-adherence evaluation of the embedded demo model, scored automatically from decoded frames.

For each of the 24 held-out (colour, shape, direction) triples (never seen in training, see
:func:`~demo_models.video.data.held_out_combinations`) it renders a clip and measures:

* colour accuracy: the mean colour of the foreground (pixels far from the border-estimated background) is
  nearest, in RGB, to the prompted colour of :data:`~demo_models.video.data.COLOURS`;
* direction accuracy: the foreground centroid moves at least 10% of the frame along the prompted axis, in the
  prompted sense, and further along it than across it;
* shape accuracy (reported, not a target): fill ratio of the foreground's bounding box (square ~0.72,
  circle ~0.79 minus anti-aliasing, triangle ~0.5);
* image-to-video: PSNR of the first output frame against the given first frame, and the same direction test.

Run::

    python -m demo_models.video.evaluate [--model DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np

from demo_models.video.data import COLOURS, DIRECTIONS, TEMPLATES, held_out_combinations


@dataclass(frozen=True, slots=True)
class ClipReading:
    """What the frames show. colour/direction/shape are None when no object was found."""

    colour: str | None
    direction: str | None
    shape: str | None
    displacement: tuple[float, float]
    foreground_fraction: float


def foreground_masks(frames: np.ndarray, threshold: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    """Boolean foreground (F, H, W) and background colour (F, 3) in [0, 1], from the median of the border."""
    x = frames.astype(np.float32) / 255.0
    border = np.concatenate([x[:, 0], x[:, -1], x[:, :, 0], x[:, :, -1]], axis=1)  # (F, 2H + 2W, 3)
    background = np.median(border, axis=1)
    distance = np.linalg.norm(x - background[:, None, None, :], axis=-1)
    return distance > threshold, background


def read_clip(frames: np.ndarray) -> ClipReading:
    """Colour, direction and shape of the (single) object in a uint8 clip (F, H, W, 3)."""
    masks, _ = foreground_masks(frames)
    fraction = float(masks.mean())
    present = masks.reshape(len(masks), -1).sum(axis=1) >= 4
    if present.sum() < 2:
        return ClipReading(None, None, None, (0.0, 0.0), fraction)
    x = frames.astype(np.float32) / 255.0
    mean_colour = x[masks].mean(axis=0)
    colour = min(COLOURS, key=lambda name: float(np.linalg.norm(mean_colour - np.array(COLOURS[name]))))
    ys, xs = np.mgrid[0:frames.shape[1], 0:frames.shape[2]]
    centroids = np.array([[xs[m].mean(), ys[m].mean()] for m in masks[present]])
    dx, dy = (centroids[-1] - centroids[0]).tolist()
    size = frames.shape[1]
    direction = None
    if max(abs(dx), abs(dy)) >= 0.1 * size:
        direction = max(DIRECTIONS, key=lambda name: DIRECTIONS[name][0] * dx + DIRECTIONS[name][1] * dy)
        ux, uy = DIRECTIONS[direction]
        if abs(ux * dx + uy * dy) <= abs(uy * dx - ux * dy):
            direction = None
    first = masks[present][0]
    rows, cols = np.nonzero(first)
    fill = first.sum() / ((np.ptp(rows) + 1) * (np.ptp(cols) + 1))
    shape = "triangle" if fill < 0.62 else "circle" if fill < 0.86 else "square"
    return ClipReading(colour, direction, shape, (dx, dy), fraction)


def trail_direction(frames: np.ndarray, colour: str) -> str | None:
    """The direction a trail points to (clips of a model trained with ``--trail``), read from single frames.

    Per frame: each pixel's share of the way from the frame's median (background) colour to ``colour``; the
    centroid of the shape's core (share > 0.75) minus that of its faded copies (0.15-0.6) points the way the shape
    moves. Summed over frames; None when no frame shows both. frames: uint8 (F, H, W, 3).
    """
    target = np.array(COLOURS[colour]) * 255.0
    ys, xs = np.mgrid[:frames.shape[1], :frames.shape[2]]
    votes = np.zeros(2)
    for frame in frames.astype(np.float64):
        background = np.median(frame.reshape(-1, 3), axis=0)
        axis = target - background
        share = (frame - background) @ axis / max(float(axis @ axis), 1e-6)
        core, faded = share > 0.75, (share > 0.15) & (share < 0.6)
        if core.sum() >= 5 and faded.sum() >= 5:
            votes += (xs[core].mean() - xs[faded].mean(), ys[core].mean() - ys[faded].mean())
    if not votes.any():
        return None
    return max(DIRECTIONS, key=lambda name: float(np.dot(DIRECTIONS[name], votes)))


def evaluate(model: str | None = None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
             seed: int = 0, combos: list | None = None, trail: int = 0, centred: bool = False) -> dict:
    """Render every held-out prompt with text-to-video and image-to-video; return accuracies and per-clip rows.
    ``trail``: the image-to-video first frames carry that many fading copies (for a model trained with them);
    ``centred``: their shapes start in the central box (``data.sample_spec``)."""
    import torch

    from metainfer_gen import pipelines
    from demo_models.video import configs
    from demo_models.video.data import first_frame, sample_spec
    from metainfer_gen.video.quality import psnr

    t2v = pipelines.TextToVideoPipeline.from_pretrained(model, device="cpu")
    t2v.set_progress_bar_config(disable=True)
    i2v = pipelines.ImageToVideoPipeline.from_pipe(t2v)
    call = {"num_inference_steps": num_inference_steps, "guidance_scale": guidance_scale}
    rows = []
    for index, combo in enumerate(combos or held_out_combinations()):
        colour, shape, direction = combo
        prompt = TEMPLATES[index % len(TEMPLATES)].format(colour=colour, shape=shape, direction=direction)
        t2v_out = t2v(prompt, seed=seed + index, **call)
        spec = sample_spec(combo, configs.NUM_FRAMES, configs.SIZE, torch.Generator().manual_seed(10_000 + index),
                           trail, centred)
        image = first_frame(spec, configs.SIZE)
        i2v_out = i2v(image, prompt, seed=seed + index, **call)
        for task, out in (("t2v", t2v_out), ("i2v", i2v_out)):
            reading = read_clip(out.frames)
            row = {"task": task, "prompt": prompt, "colour": colour, "shape": shape, "direction": direction,
                   "read": asdict(reading), "seconds": round(out.stats.seconds, 2)}
            if task == "i2v":
                row["first_frame_psnr"] = round(psnr(out.frames[0], image), 2)
            if trail:
                row["trail_direction"] = trail_direction(out.frames, colour)
            rows.append(row)
    summary = {}
    for task in ("t2v", "i2v"):
        task_rows = [r for r in rows if r["task"] == task]
        summary[task] = {
            "clips": len(task_rows),
            "colour_accuracy": np.mean([r["read"]["colour"] == r["colour"] for r in task_rows]).item(),
            "direction_accuracy": np.mean([r["read"]["direction"] == r["direction"] for r in task_rows]).item(),
            "shape_accuracy": np.mean([r["read"]["shape"] == r["shape"] for r in task_rows]).item(),
            "mean_seconds": np.mean([r["seconds"] for r in task_rows]).item(),
        }
        if trail:  # does the trail, a per-frame cue, point where the word says?
            summary[task]["trail_direction_accuracy"] = np.mean(
                [r["trail_direction"] == r["direction"] for r in task_rows]).item()
    i2v_rows = [r for r in rows if r["task"] == "i2v"]
    summary["i2v"]["first_frame_psnr_min"] = min(r["first_frame_psnr"] for r in i2v_rows)
    summary["i2v"]["first_frame_psnr_mean"] = float(np.mean([r["first_frame_psnr"] for r in i2v_rows]))
    return {"summary": summary, "settings": {k: t2v.default(k) if v is None else v for k, v in call.items()},
            "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    parser.add_argument("--steps", type=int, default=None, help="num_inference_steps (model default if omitted)")
    parser.add_argument("--guidance-scale", type=float, default=None, help="guidance (model default if omitted)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first clip; clip i uses seed + i")
    parser.add_argument("--json", default=None, help="also write the full result to this file")
    parser.add_argument("--trail", type=int, default=0,
                        help="fading copies in the image-to-video first frames (a model trained with --trail)")
    parser.add_argument("--centred-start", action="store_true",
                        help="image-to-video first frames start in the central box (a model trained with it)")
    args = parser.parse_args(argv)
    result = evaluate(args.model, args.steps, args.guidance_scale, args.seed, trail=args.trail,
                      centred=args.centred_start)
    print(json.dumps({"summary": result["summary"], "settings": result["settings"]}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
