"""Step cache at few steps: where does reuse stop keeping the clip? (sets ``StepCacheConfig.min_inference_steps``)

    OMP_NUM_THREADS=1 python benchmarks/step_cache_few_steps.py    # 81 frames, T2V + I2V, 8 prompts, 4..20 steps
    OMP_NUM_THREADS=1 python benchmarks/step_cache_few_steps.py \
        --step-lora metainfer_gen/assets/loras/steps_4_8.safetensors \
        --frames 17 --tasks t2v   # the step LoRA at 4, 6, 8 unguided steps: auto as shipped and with its guard off
    python benchmarks/step_cache_few_steps.py --steps 4,8 --num-prompts 1 --frames 17 --tasks t2v   # smoke run

For every step count and named preset ("quality", "auto", "fast") the clip is rendered with the few-step guard
switched off (``min_inference_steps=None``: the reuse the preset would do without it) and compared with the
uncached clip of the same prompt, seed and step count. Held-out demo prompts (never trained on), the shipped
calibration beside the embedded model, the model's default guidance; the registry's kernels outside the
transformer blocks (VAE convolutions and norms), which only make the decode faster. Columns: PSNR (dB) mean and
worst over the prompts (identical clips count 100 dB); "kept": the share of clips whose colour and direction, read
back from the frames (``demo_models.video.evaluate.read_clip``), are those of the uncached clip; reused transformer
calls per clip (both CFG branches) out of ``2 * steps``; seconds of the pipeline call and transformer block
evaluations per clip (the first prompt's clip is rendered once untimed first, to warm up).
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
from table import print_table, run_footer, run_header  # noqa: E402

PRESET_NAMES = ("quality", "auto", "fast")


def unguarded(name: str):
    """The preset ``name`` as ``enable_step_cache(name)`` builds it, with the few-step guards off."""
    from metainfer_gen.video.cache.config import StepCacheConfig
    from metainfer_gen.video.cache.policy import StepCachePolicy

    config = StepCacheConfig.preset(name, min_inference_steps=None, min_unguided_inference_steps=None)
    return StepCachePolicy(config, name=name, find_calibration=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default=None, help="comma-separated step counts (default 4,6,8,10,12,16,20; "
                                                      "with --step-lora 4,6,8)")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts per task (default 8)")
    parser.add_argument("--frames", type=int, default=81, help="num_frames (4k+1; default 81)")
    parser.add_argument("--tasks", default="t2v,i2v", help="comma-separated t2v, i2v (default both)")
    parser.add_argument("--policies", default=None, help="comma-separated named presets (default quality,auto,fast; "
                                                         "with --step-lora auto)")
    parser.add_argument("--step-lora", default=None, metavar="FILE",
                        help="render with this step LoRA, unguided (guidance 1), as the few-step runs it was "
                             "distilled for; adds the preset as shipped (its few-step guard on) beside each row")
    parser.add_argument("--guidance-scale", type=float, default=None,
                        help="CFG scale of every clip (default: the model's, 4; with --step-lora 1)")
    args = parser.parse_args(argv)

    import time

    from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline

    print(run_header(), flush=True)
    start = time.perf_counter()
    t2v = TextToVideoPipeline.from_pretrained()
    t2v.set_progress_bar_config(disable=True)
    t2v.enable_fused_kernels(config=OUTSIDE_BLOCKS)
    extra: dict = {}
    if args.step_lora:
        t2v.load_lora(args.step_lora, adapter_name="steps")
        extra["guidance_scale"] = 1.0
    if args.guidance_scale is not None:
        extra["guidance_scale"] = args.guidance_scale
    pipes = {"t2v": t2v, "i2v": ImageToVideoPipeline.from_pipe(t2v)}
    items = prompts_and_images(args.num_prompts, t2v.default("height"), args.frames)
    default_policies = "auto" if args.step_lora else ",".join(PRESET_NAMES)
    policies = [p for p in (args.policies or default_policies).split(",") if p]
    variants = []  # (row name, what enable_step_cache gets)
    for name in policies:
        if args.step_lora:
            variants.append((f"{name} (as shipped)", name))
        variants.append((f"{name} (guard off)", unguarded(name)))
    steps_list = args.steps or ("4,6,8" if args.step_lora else "4,6,8,10,12,16,20")
    rows = []
    for task in [t for t in args.tasks.split(",") if t]:
        pipe = pipes[task]
        for steps in [int(s) for s in steps_list.split(",") if s]:
            results: dict[str, list] = {"off": [], **{name: [] for name, _ in variants}}
            for index, (prompt, image, _) in enumerate(items):
                inputs = (prompt,) if task == "t2v" else (image, prompt)
                call = dict(num_frames=args.frames, num_inference_steps=steps, seed=index, **extra)
                if index == 0:
                    pipe(*inputs, **call)  # untimed warm-up
                reference = pipe(*inputs, **call)
                expected = read_clip(reference.frames)
                results["off"].append((reference, 100.0, True))
                for name, cache in variants:
                    pipe.enable_step_cache(cache)
                    try:
                        out = pipe(*inputs, **call)
                    finally:
                        pipe.disable_step_cache()
                    reading = read_clip(out.frames)
                    results[name].append((out, min(psnr(out.frames, reference.frames), PSNR_CAP_DB),
                                          (reading.colour, reading.direction) == (expected.colour,
                                                                                  expected.direction)))
            for name, outs in results.items():
                rows.append(_row(task, steps, name, outs))
                print(" | ".join(rows[-1]), flush=True)
    print(f"{args.frames} frames, {args.num_prompts} held-out prompts, "
          + (f"step LoRA {Path(args.step_lora).name}, " if args.step_lora else "base model, ")
          + f"guidance {extra.get('guidance_scale', t2v.default('guidance_scale'))}")
    print_table(["task", "steps", "policy", "s/clip", "blocks/clip", "PSNR mean dB", "PSNR worst dB", "kept",
                 "reused calls/clip", "cache note"], rows)
    print(run_footer(time.perf_counter() - start))
    return 0


def _row(task: str, steps: int, name: str, outs: list) -> list[str]:
    """One table row from ``[(output, PSNR, kept), ...]`` over the prompts."""
    scores = [score for _, score, _ in outs]
    caches = [out.stats.cache or {} for out, _, _ in outs]
    reused = [cache.get("num_reused", 0) for cache in caches]
    calls = outs[0][0].stats.transformer_calls
    note = next((c["disabled_reason"].split(":")[0] for c in caches if c.get("disabled_reason")), "")
    return [task, str(steps), name, f"{np.mean([o.stats.seconds for o, _, _ in outs]):.2f}",
            f"{np.mean([o.stats.block_evaluations for o, _, _ in outs]):.0f}", f"{np.mean(scores):.1f}",
            f"{min(scores):.1f}", f"{sum(k for _, _, k in outs)}/{len(outs)}", f"{np.mean(reused):.1f} / {calls}",
            note]


if __name__ == "__main__":
    sys.exit(main())
