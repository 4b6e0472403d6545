"""Step-reduction LoRA and step cache, alone and together: one table from one run.

    OMP_NUM_THREADS=1 python benchmarks/lora.py --step-lora metainfer_gen/assets/loras/steps_4_8.safetensors --repeats 2
    python benchmarks/lora.py --model DIR --step-lora FILE --num-prompts 2 --size 32 --num-frames 5   # smoke run

Rows: the base model at ``--steps`` (30) with its default guidance; the same with the step cache (``--cache``,
default "auto"); the step-reduction LoRA at each of ``--lora-steps`` (4, 8) without guidance (what it was
distilled for); and the LoRA with the cache at each of those. The base rows run on a pipeline without the LoRA, the
LoRA rows on a second copy with it loaded (unfused), so neither pays for the other. Rows run round-robin per prompt
and each (row, prompt) is rendered ``--repeats`` times in that order, the fastest clip counting (as
``step_cache.py`` does, through ``rounds.round_robin``); every row gets one untimed warm-up call first. Every row
runs the lossless condition-embedder memo (``--embed-memo off``: none does). Columns, as means per clip over
held-out demo prompts: end-to-end seconds of the pipeline call, speedup against the base row, prompt-adherence
score (0-100: mean of colour and direction accuracy read back from the frames), PSNR (dB, mean and worst clip;
identical clips count 100) and SSIM against the base row's clip of the same prompt and seed, and the transformer
calls the cache reused (with the reason when it stood aside).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo_models.video import lora_eval  # noqa: E402
from rounds import clip_psnr, round_robin  # noqa: E402  (benchmarks/ is on the path when a script here runs)
from table import run_footer, run_header  # noqa: E402

WARMUP_SEED = 10_000


def make_row(pipe, call: dict, cache):
    """``render(index, (prompt, combo))``: one clip, seed = index, with ``cache`` (a policy, or None) enabled for
    just this call."""
    def render(index: int, item):
        if cache is not None:
            pipe.enable_step_cache(cache)
        try:
            return pipe(item[0], seed=index, **call)
        finally:
            pipe.disable_step_cache()
    return render


def summarise(name: str, outputs: list, prompts, reference: list | None) -> dict:
    """Means per clip; PSNR (mean, worst clip) and SSIM against ``reference`` clips of the same prompts and seeds."""
    from metainfer_gen.video.quality import ssim

    clips = [out.frames for out in outputs]
    caches = [out.stats.cache or {} for out in outputs]
    reused = sum(c.get("num_reused", 0) for c in caches)
    total = sum(c.get("num_reused", 0) + c.get("num_computed", 0) for c in caches)
    reasons = {c.get("disabled_reason") for c in caches if c.get("disabled_reason")}
    row = {"name": name, "seconds": float(np.mean([out.stats.seconds for out in outputs])),
           "score": lora_eval.adherence(clips, prompts)["score"],
           "cache": "-" if not caches[0] else f"{reused}/{total} reused" + (" (off: too few steps)" if reasons else "")}
    if reference is not None:
        psnrs = [clip_psnr(c, r) for c, r in zip(clips, reference)]
        row.update(psnr=float(np.mean(psnrs)), psnr_worst=float(np.min(psnrs)),
                   ssim=float(np.mean([ssim(c, r) for c, r in zip(clips, reference)])))
    return row


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    parser.add_argument("--step-lora", required=True, help="the step-reduction LoRA (train_step_lora's output)")
    parser.add_argument("--steps", type=int, default=30, help="steps of the base rows")
    parser.add_argument("--lora-steps", default="4,8", help="comma-separated steps of the LoRA rows")
    parser.add_argument("--cache", default="auto", help="step-cache policy of the cached rows")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out demo prompts per row")
    parser.add_argument("--num-frames", type=int, default=None, help="frames (default: the model's)")
    parser.add_argument("--size", type=int, default=None, help="height and width (default: the model's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="clips per row and prompt, round-robin; the fastest counts (default 1)")
    parser.add_argument("--embed-memo", choices=("on", "off"), default="on",
                        help="the lossless condition-embedder memo on every row (default on) or on none")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    started = time.perf_counter()
    print(run_header(), flush=True)

    from metainfer_gen.pipelines import TextToVideoPipeline
    from metainfer_gen.video.cache import make_policy

    pipes = {}
    for kind in ("base", "lora"):
        pipe = TextToVideoPipeline.from_pretrained(args.model, device="cpu")
        pipe.set_progress_bar_config(disable=True)
        if kind == "lora":
            pipe.load_lora(args.step_lora, adapter_name="steps")
        if args.embed_memo == "on":
            pipe.enable_embed_memo()
        pipes[kind] = pipe
    prompts = lora_eval.held_out_prompts(args.num_prompts)
    shape = {"num_frames": args.num_frames, "height": args.size, "width": args.size}
    base_call = {**shape, "num_inference_steps": args.steps}
    rows = {f"base {args.steps} steps": make_row(pipes["base"], base_call, None),
            f"base {args.steps} steps + cache {args.cache}": make_row(pipes["base"], base_call,
                                                                      make_policy(args.cache))}
    for steps in [int(s) for s in args.lora_steps.split(",")]:
        call = {**shape, "num_inference_steps": steps, "guidance_scale": 1.0}
        rows[f"step LoRA {steps} steps"] = make_row(pipes["lora"], call, None)
        rows[f"step LoRA {steps} steps + cache {args.cache}"] = make_row(pipes["lora"], call, make_policy(args.cache))
    for render in rows.values():  # warm-up: first calls are slower
        render(WARMUP_SEED, prompts[0])
    outputs = round_robin(rows, prompts, args.repeats,
                          on_item=lambda i: print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True))
    names = list(rows)
    reference = [out.frames for out in outputs[names[0]]]
    summaries = [summarise(name, outputs[name], prompts, None if name == names[0] else reference) for name in names]
    base = summaries[0]
    print(f"every row: embed memo {args.embed_memo}, {torch.get_num_threads()} threads, {len(prompts)} prompts, "
          f"fastest of {args.repeats} per clip, rows round-robin per prompt; PSNR/SSIM against the base row's clip")
    print("| row | seconds | speedup | adherence | PSNR dB | PSNR worst dB | SSIM | cache |")
    print("|---|---|---|---|---|---|---|---|")
    for row in summaries:
        quality = f"{row['psnr']:.1f} | {row['psnr_worst']:.1f} | {row['ssim']:.3f}" if "psnr" in row else "- | - | -"
        print(f"| {row['name']} | {row['seconds']:.2f} | {base['seconds'] / row['seconds']:.2f}x | "
              f"{row['score']:.1f} | {quality} | {row['cache']} |")
    print(run_footer(time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
