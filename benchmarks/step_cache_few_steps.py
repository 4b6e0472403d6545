"""Step cache at few steps: where does reuse stop keeping the clip? (sets ``StepCacheConfig.min_inference_steps``)

    OMP_NUM_THREADS=1 python benchmarks/step_cache_few_steps.py    # 81 frames, T2V + I2V, 8 prompts, 4..20 steps
    python benchmarks/step_cache_few_steps.py --steps 4,8 --num-prompts 1 --frames 17 --tasks t2v   # smoke run

For every step count and named preset ("quality", "auto", "fast") the clip is rendered with the few-step guard
switched off (``min_inference_steps=None``: the reuse the preset would do without it) and compared with the
uncached clip of the same prompt, seed and step count. Held-out demo prompts (never trained on), the shipped
calibration beside the embedded model, the model's default guidance; the registry's kernels outside the
transformer blocks (VAE convolutions and norms), which only make the decode faster. Columns: PSNR (dB) mean and
worst over the prompts (identical clips count 100 dB); "kept": the share of clips whose colour and direction, read
back from the frames (``demo_models.video.evaluate.read_clip``), are those of the uncached clip; reused transformer
calls per clip (both CFG branches) out of ``2 * steps``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.step_cache import OUTSIDE_BLOCKS, prompts_and_images  # noqa: E402
from demo_models.video.evaluate import read_clip  # noqa: E402
from metainfer_gen.video.quality import psnr  # noqa: E402
from rounds import PSNR_CAP_DB  # noqa: E402  (benchmarks/ is on the path when a script here runs)

PRESET_NAMES = ("quality", "auto", "fast")


def unguarded(name: str):
    """The preset ``name`` as ``enable_step_cache(name)`` builds it, with the few-step guard off."""
    from metainfer_gen.video.cache.config import StepCacheConfig
    from metainfer_gen.video.cache.policy import StepCachePolicy

    config = StepCacheConfig.preset(name, min_inference_steps=None)
    return StepCachePolicy(config, name=name, find_calibration=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="4,6,8,10,12,16,20", help="comma-separated step counts")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts per task (default 8)")
    parser.add_argument("--frames", type=int, default=81, help="num_frames (4k+1; default 81)")
    parser.add_argument("--tasks", default="t2v,i2v", help="comma-separated t2v, i2v (default both)")
    parser.add_argument("--policies", default=",".join(PRESET_NAMES), help="comma-separated named presets")
    args = parser.parse_args(argv)

    from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline

    t2v = TextToVideoPipeline.from_pretrained()
    t2v.set_progress_bar_config(disable=True)
    t2v.enable_fused_kernels(config=OUTSIDE_BLOCKS)
    pipes = {"t2v": t2v, "i2v": ImageToVideoPipeline.from_pipe(t2v)}
    items = prompts_and_images(args.num_prompts, t2v.default("height"), args.frames)
    policies = [p for p in args.policies.split(",") if p]
    print("| task | steps | policy | PSNR mean dB | PSNR worst dB | kept | reused calls/clip |\n"
          "|---|---|---|---|---|---|---|")
    for task in [t for t in args.tasks.split(",") if t]:
        pipe = pipes[task]
        for steps in [int(s) for s in args.steps.split(",") if s]:
            scores: dict[str, list[float]] = {p: [] for p in policies}
            reused: dict[str, list[int]] = {p: [] for p in policies}
            kept: dict[str, list[bool]] = {p: [] for p in policies}
            for index, (prompt, image, _) in enumerate(items):
                inputs = (prompt,) if task == "t2v" else (image, prompt)
                call = dict(num_frames=args.frames, num_inference_steps=steps, seed=index)
                reference = pipe(*inputs, **call).frames
                expected = read_clip(reference)
                for name in policies:
                    pipe.enable_step_cache(unguarded(name))
                    try:
                        out = pipe(*inputs, **call)
                    finally:
                        pipe.disable_step_cache()
                    scores[name].append(min(psnr(out.frames, reference), PSNR_CAP_DB))
                    reused[name].append(out.stats.cache["num_reused"])
                    reading = read_clip(out.frames)
                    kept[name].append((reading.colour, reading.direction) == (expected.colour, expected.direction))
            for name in policies:
                print(f"| {task} | {steps} | {name} | {np.mean(scores[name]):.1f} | {min(scores[name]):.1f} | "
                      f"{sum(kept[name])}/{len(kept[name])} | {np.mean(reused[name]):.1f} / {2 * steps} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
