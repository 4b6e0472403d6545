"""Step-cache benchmark: no cache vs the public caches vs ours, one table from one run.

    python benchmarks/step_cache.py       # embedded model: 50 steps, 8 prompts, T2V + I2V; then a larger random Wan
    python benchmarks/step_cache.py --steps 4 --num-prompts 1 --quick   # smoke run (tiny sizes, no claim)

Rows: no cache, diffusers FirstBlockCache at two thresholds, MagCache (its own calibration run first), TaylorSeer,
cache-dit DBCache (when installed), ours at three quality settings. Columns, as means per clip: transformer block
evaluations (counted on a Linear inside each block, so every cache is counted the same way), end-to-end seconds
of the pipeline call, speedup against no cache, PSNR (dB) and SSIM of the decoded clip against the uncached clip
of the same seed and prompt (identical clips count 100 dB), and the demo model's prompt adherence (colour and
direction read back from the frames; ``-`` on the random model). Every policy gets one untimed warm-up call first
(MagCache calibrates there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen.video.quality import psnr, ssim  # noqa: E402

POLICIES = ("off", "fbcache=0.05", "fbcache=0.1", "magcache", "taylorseer", "dbcache", "quality", "balanced", "fast")
PSNR_CAP_DB = 100.0  # identical clips (infinite PSNR) count as 100 dB in the means
COLUMNS = ("setup", "policy", "blocks", "seconds", "speedup", "psnr_db", "ssim", "adherence")


def prompts_and_images(num_prompts: int, size: int, num_frames: int) -> list[tuple[str, np.ndarray, tuple]]:
    """Held-out demo prompts (never trained on) and a matching first frame for image-to-video."""
    import torch

    from metainfer_gen.video.demo_model.data import TEMPLATES, held_out_combinations, render_clip, sample_spec

    items = []
    for index, combo in enumerate(held_out_combinations()[:num_prompts]):
        colour, shape, direction = combo
        prompt = TEMPLATES[index % len(TEMPLATES)].format(colour=colour, shape=shape, direction=direction)
        spec = sample_spec(combo, num_frames, size, torch.Generator().manual_seed(10_000 + index))
        video, _ = render_clip(spec, 1, size)
        image = ((video[:, 0].permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
        items.append((prompt, image, combo))
    return items


def adherence(frames: np.ndarray, combo: tuple) -> float:
    """Half a point each for the colour and the direction read back from the frames."""
    from metainfer_gen.video.demo_model.evaluate import read_clip

    reading = read_clip(frames)
    return 0.5 * (reading.colour == combo[0]) + 0.5 * (reading.direction == combo[2])


def large_random_pipeline(device: str, dtype, num_layers: int, width: int):
    """The embedded model's VAE and text encoder with a larger random-initialised Wan transformer."""
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel

    from metainfer_gen.pipelines import TextToVideoPipeline
    from metainfer_gen.video.demo_model import configs

    small = TextToVideoPipeline.from_pretrained(None, device=device, torch_dtype=dtype)
    base = small.diffusers_pipeline
    heads = max(width // 64, 1)
    torch.manual_seed(0)
    random = WanTransformer3DModel(**{**configs.TRANSFORMER_CONFIG, "num_layers": num_layers,
                                      "num_attention_heads": heads, "attention_head_dim": width // heads,
                                      "ffn_dim": 4 * width})
    with tempfile.TemporaryDirectory() as folder:  # from_pretrained keeps Wan's float32 modules in float32
        random.save_pretrained(folder)
        transformer = WanTransformer3DModel.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
    pipe = WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                       transformer=transformer, scheduler=base.scheduler, expand_timesteps=True)
    return TextToVideoPipeline(pipe, settings=small.settings, source="random-large")


def run_policy(t2v, i2v, task: str, policy: str, items, call: dict, reference: dict | None, score: bool) -> dict:
    """Render every item with ``policy`` on ``task``; return the row (means per clip) and the clips if uncached."""
    pipe = t2v if task == "t2v" else i2v
    pipe.enable_step_cache(policy)
    try:
        def render(index: int):
            prompt, image, _ = items[index]
            args = (prompt,) if task == "t2v" else (image, prompt)
            return pipe(*args, seed=index, **call)

        render(0)  # warm-up (and MagCache's calibration); not timed
        outputs = [render(index) for index in range(len(items))]
    finally:
        pipe.disable_step_cache()
    row = {"policy": policy, "blocks": np.mean([o.stats.block_evaluations for o in outputs]),
           "seconds": np.mean([o.stats.seconds for o in outputs]), "clips": [o.frames for o in outputs]}
    if reference is not None:
        pairs = list(zip(outputs, reference["clips"]))
        row["psnr_db"] = float(np.mean([min(psnr(o.frames, r), PSNR_CAP_DB) for o, r in pairs]))
        row["ssim"] = float(np.mean([ssim(o.frames, r) for o, r in pairs]))
        row["speedup"] = reference["seconds"] / row["seconds"]
    else:
        row.update(psnr_db=PSNR_CAP_DB, ssim=1.0, speedup=1.0)
    row["adherence"] = float(np.mean([adherence(o.frames, c) for o, (_, _, c) in zip(outputs, items)])) \
        if score else None
    return row


def bench_setup(name: str, t2v, i2v, tasks: list[str], policies: list[str], items, call: dict,
                score: bool) -> list[dict]:
    rows = []
    for task in tasks:
        reference = None
        for policy in policies:
            row = run_policy(t2v, i2v, task, policy, items, call, reference, score)
            reference = reference or row
            row["setup"] = f"{name} {task}"
            rows.append(row)
            print(format_row(row), file=sys.stderr, flush=True)  # progress; the table is printed at the end
    return rows


def format_row(row: dict) -> str:
    def cell(key):
        value = row.get(key)
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3f}" if key in ("ssim", "adherence", "speedup") else f"{value:.2f}"
        return str(value)

    return "| " + " | ".join(cell(key) for key in COLUMNS) + " |"


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    parser.add_argument("--steps", type=int, default=50, help="num_inference_steps (default 50)")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts per task (default 8)")
    parser.add_argument("--tasks", default="t2v,i2v", help="comma-separated: t2v, i2v (default both)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated cache specs")
    parser.add_argument("--guidance-scale", type=float, default=None, help="CFG weight (model default if omitted)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--large-layers", type=int, default=12, help="blocks of the larger random Wan (0: skip it)")
    parser.add_argument("--large-width", type=int, default=512, help="hidden size of the larger random Wan")
    parser.add_argument("--large-size", type=int, default=128, help="frame height and width on the larger model")
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 frames at 32x32 (64x64 for SSIM)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)

    from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline

    policies = [p for p in args.policies.split(",") if p]
    if "dbcache" in policies and importlib.util.find_spec("cache_dit") is None:
        print("cache-dit not installed: dbcache row skipped (pip install cache-dit)", file=sys.stderr)
        policies.remove("dbcache")
    tasks = [t for t in args.tasks.split(",") if t]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    frames = 5 if args.quick else 17
    call = {"num_inference_steps": args.steps, "num_frames": frames}
    if args.guidance_scale is not None:
        call["guidance_scale"] = args.guidance_scale
    t2v = TextToVideoPipeline.from_pretrained(args.model, device=args.device, torch_dtype=dtype)
    t2v.set_progress_bar_config(disable=True)
    size = t2v.default("height")
    items = prompts_and_images(args.num_prompts, size, frames)
    rows = bench_setup("embedded" if args.model is None else Path(args.model).name, t2v,
                       ImageToVideoPipeline.from_pipe(t2v), tasks, policies, items, call, score=args.model is None)
    if args.large_layers > 0:
        large = large_random_pipeline(args.device, dtype, args.large_layers, args.large_width)
        large.set_progress_bar_config(disable=True)
        large_size = 64 if args.quick else args.large_size
        large_call = {**call, "height": large_size, "width": large_size}
        rows += bench_setup(f"random-wan-{args.large_layers}x{args.large_width}", large,
                            ImageToVideoPipeline.from_pipe(large), ["t2v"], policies,
                            prompts_and_images(args.num_prompts, large_size, frames), large_call, score=False)
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    print("\n".join(format_row(row) for row in rows))
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "clips"} for r in rows],
                                              indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
