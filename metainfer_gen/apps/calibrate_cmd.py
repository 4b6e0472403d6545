"""``metainfer-gen calibrate``: measure the step cache's signal-to-error ratios from one uncached run per prompt.

    metainfer-gen calibrate --model path/to/pipeline            # writes path/to/pipeline/step_cache_calibration.json
    metainfer-gen calibrate --output my_model_cache.json        # the embedded model, to a path of your choice

The "auto" / "quality" / "balanced" / "fast" caches then read the file beside the model on their own; a file kept
elsewhere is passed as ``StepCacheConfig(calibration=calibration.load(path))`` or ``render --cache-calibration``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_PROMPTS = ("a red circle moving right", "the blue square moves up")


def add_calibrate_parser(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure the step cache's signal-to-error mapping for a model",
                              description="Run the model uncached on one or more prompts, record per step how much "
                                          "the transformer residual changed per unit of the cache's signal, and "
                                          "store it as JSON beside model_index.json (or at --output).")
    p.add_argument("--model", default=None, help="diffusers pipeline folder (default: the embedded model)")
    p.add_argument("--output", default=None, help="file or folder to write (default: beside the model's "
                                                   "model_index.json; required for the embedded model or a hub id)")
    p.add_argument("--prompt", action="append", default=None,
                   help=f"prompt to run (repeatable; default: {', '.join(DEFAULT_PROMPTS)})")
    p.add_argument("--steps", "--num-inference-steps", dest="steps", type=int, default=50,
                   help="num_inference_steps to measure at (default 50); other counts interpolate over the schedule")
    p.add_argument("--signal", choices=("input", "first_block"), default="input",
                   help="the signal the cache will use (default input)")
    p.add_argument("--num-frames", type=int, default=None, help="frames (model default if omitted)")
    p.add_argument("--height", type=int, default=None, help="height in pixels (model default if omitted)")
    p.add_argument("--width", type=int, default=None, help="width in pixels (model default if omitted)")
    p.add_argument("--guidance-scale", type=float, default=None, help="CFG weight (model default if omitted)")
    p.add_argument("--seed", type=int, default=0, help="seed of the runs (default 0)")
    p.add_argument("--device", default=None, help="cpu, cuda ... (default: cuda if available)")
    p.set_defaults(func=run_calibrate)


def output_path(model: str | None, output: str | None) -> Path:
    """Where the file goes. Raises ValueError when there is no model folder to write beside and no --output."""
    from metainfer_gen.video.cache.calibration import FILE_NAME

    if output is not None:
        path = Path(output)
        return path / FILE_NAME if path.is_dir() else path
    if model is None or not (Path(model) / "model_index.json").is_file():
        raise ValueError("give --output PATH: there is no pipeline folder to write beside "
                         f"({'the embedded model ships read-only' if model is None else model})")
    return Path(model) / FILE_NAME


def run_calibrate(args: argparse.Namespace) -> int:
    from metainfer_gen.pipelines import TextToVideoPipeline
    from metainfer_gen.video.cache.calibrate import calibrate

    path = output_path(args.model, args.output)  # refuse before loading anything
    pipe = TextToVideoPipeline.from_pretrained(args.model, device=args.device)
    pipe.set_progress_bar_config(disable=True)
    call = {k: v for k, v in (("num_frames", args.num_frames), ("height", args.height), ("width", args.width),
                               ("guidance_scale", args.guidance_scale)) if v is not None}
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    result = calibrate(pipe, prompts, num_inference_steps=args.steps, signal=args.signal, seed=args.seed, **call)
    written = result.save(path)
    for name, curve in result.curves.items():
        ratios = ", ".join(f"{r:.2f}" for r in curve.reuse_ratio[:: max(len(curve.reuse_ratio) // 8, 1)])
        print(f"{name}: reuse ratio over the schedule {ratios}")
    print(f"wrote {written} ({len(prompts)} prompt(s), {args.steps} steps, signal={args.signal})")
    return 0
