"""Step-reduction LoRA and step cache, alone and together: one table from one run.

    OMP_NUM_THREADS=2 python benchmarks/lora.py --step-lora build/demo_model/step_lora/step_lora.safetensors
    python benchmarks/lora.py --model DIR --step-lora FILE --num-prompts 2 --size 32 --num-frames 5   # smoke run

Rows: the base model at ``--steps`` (30) with its default guidance; the same with the step cache (``--cache``,
default "auto"); the step-reduction LoRA at each of ``--lora-steps`` (4, 8) without guidance (what it was
distilled for); and the LoRA with the cache at each of those. Columns, as means per clip over held-out demo
prompts: end-to-end seconds of the pipeline call, speedup against the base row, prompt-adherence score (0-100:
mean of colour and direction accuracy read back from the frames), PSNR (dB; identical clips count 100) and SSIM
against the base row's clip of the same prompt and seed, and the transformer calls the cache reused (with the
reason when it stood aside). Each row gets one untimed warm-up call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo_models.video import lora_eval  # noqa: E402

PSNR_CAP_DB = 100.0


def run_row(pipe, name: str, prompts, call: dict, reference: list | None) -> tuple[dict, list]:
    """Render every prompt once (after one warm-up call) and summarise against ``reference`` clips."""
    pipe(prompts[0][0], seed=10_000, **call)  # warm-up: first calls are slower
    outputs = [pipe(prompt, seed=index, **call) for index, (prompt, _) in enumerate(prompts)]
    clips = [out.frames for out in outputs]
    caches = [out.stats.cache or {} for out in outputs]
    reused = sum(c.get("num_reused", 0) for c in caches)
    total = sum(c.get("num_reused", 0) + c.get("num_computed", 0) for c in caches)
    reasons = {c.get("disabled_reason") for c in caches if c.get("disabled_reason")}
    row = {"name": name, "seconds": float(np.mean([out.stats.seconds for out in outputs])),
           "score": lora_eval.adherence(clips, prompts)["score"],
           "cache": "-" if not caches[0] else f"{reused}/{total} reused" + (" (off: too few steps)" if reasons else "")}
    if reference is not None:
        quality = lora_eval.fidelity(clips, reference)
        row.update(psnr=min(quality["psnr"], PSNR_CAP_DB), ssim=quality["ssim"])
    return row, clips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    parser.add_argument("--step-lora", required=True, help="the step-reduction LoRA (train_step_lora's output)")
    parser.add_argument("--steps", type=int, default=30, help="steps of the base rows")
    parser.add_argument("--lora-steps", default="4,8", help="comma-separated steps of the LoRA rows")
    parser.add_argument("--cache", default="auto", help="step-cache policy of the cached rows")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out demo prompts per row")
    parser.add_argument("--num-frames", type=int, default=None, help="frames (default: the model's)")
    parser.add_argument("--size", type=int, default=None, help="height and width (default: the model's)")
    args = parser.parse_args(argv)

    from metainfer_gen.pipelines import TextToVideoPipeline

    pipe = TextToVideoPipeline.from_pretrained(args.model, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    prompts = lora_eval.held_out_prompts(args.num_prompts)
    shape = {"num_frames": args.num_frames, "height": args.size, "width": args.size}
    base_call = {**shape, "num_inference_steps": args.steps}
    base, reference = run_row(pipe, f"base {args.steps} steps", prompts, base_call, None)
    rows = [base]
    pipe.enable_step_cache(args.cache)
    rows.append(run_row(pipe, f"base {args.steps} steps + cache {args.cache}", prompts, base_call, reference)[0])
    pipe.disable_step_cache()
    pipe.load_lora(args.step_lora, adapter_name="steps")
    for steps in [int(s) for s in args.lora_steps.split(",")]:
        call = {**shape, "num_inference_steps": steps, "guidance_scale": 1.0}
        rows.append(run_row(pipe, f"step LoRA {steps} steps", prompts, call, reference)[0])
        pipe.enable_step_cache(args.cache)
        rows.append(run_row(pipe, f"step LoRA {steps} steps + cache {args.cache}", prompts, call, reference)[0])
        pipe.disable_step_cache()
    print("| row | seconds | speedup | adherence | PSNR dB | SSIM | cache |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        quality = f"{row['psnr']:.1f} | {row['ssim']:.3f}" if "psnr" in row else "- | -"
        print(f"| {row['name']} | {row['seconds']:.2f} | {base['seconds'] / row['seconds']:.2f}x | "
              f"{row['score']:.1f} | {quality} | {row['cache']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
