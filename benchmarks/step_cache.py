"""Step-cache benchmark: no cache vs the public caches vs ours, one table from one run.

    python benchmarks/step_cache.py --setups embedded   # embedded model: 50 steps, 8 prompts, T2V + I2V
    python benchmarks/step_cache.py --setups random     # random Wan 4x384 + tiny random VAE, 30 steps, CFG off
    python benchmarks/step_cache.py --steps 4 --num-prompts 1 --quick   # smoke run (tiny sizes, no claim)
    OMP_NUM_THREADS=1 python benchmarks/step_cache.py --setups embedded --tasks t2v --num-prompts 4 --repeats 2 \
        --policies off,fbcache=0.05,fbcache=0.1,magcache,taylorseer,dbcache,quality,auto,fast   # shared machine

Rows: no cache, diffusers FirstBlockCache at two thresholds, MagCache (its own calibration run first), TaylorSeer,
cache-dit DBCache (when installed), ours at three quality settings. Ours uses a calibration measured in the same
process by ``video.cache.calibrate.calibrate`` on a prompt and seed that are not among the rows' (as
``metainfer-gen calibrate`` would store beside the model); ``--online`` fits the ratios online instead. Neither
MagCache's nor our calibration run is timed. Columns, as means per clip: transformer block
evaluations (counted on a Linear inside each block, so every cache is counted the same way), end-to-end seconds
of the pipeline call, speedup against no cache, PSNR (dB) and SSIM of the decoded clip against the uncached clip
of the same seed and prompt (identical clips count 100 dB), and the demo model's prompt adherence (colour and
direction read back from the frames; ``-`` on the random model). Policies run round-robin per prompt, so machine
load drifting over the run hits all of them alike; an untimed uncached call warms the process up first, and
MagCache gets one untimed call more (it calibrates there). Every row runs the registry's kernels outside the
transformer blocks (``--kernels stock`` keeps diffusers' own, which PyTorch sends to slow paths here): the VAE's
causal convolutions on ``conv3d`` (oneDNN on the CPU) and its norms on ``channel_rms_norm``, the condition
embedder's per-token timestep MLP on ``timestep_embedding`` (once per distinct timestep): the parts of a clip a
step cache does not skip, the same for all rows. The blocks, which the caches skip, stay diffusers' own. Every
row also runs the condition-embedder memo (``pipe.enable_embed_memo()``: lossless reuse of the embedder's outputs
within a call, about 6% of a ``fast`` clip, once installed by our step cache alone); ``--embed-memo off`` runs it on
no row. The line above the table states both, with the threads; PSNR is given as the mean and the worst clip.
``--vae-dtype bfloat16`` runs the embedded model's VAE in bf16 for every row (the decode, a fixed cost no cache
shortens, runs about 1.5x faster on a CPU with native bf16); the table's PSNR stays against the uncached clip of the
same setup, and the run prints the decode's PSNR against float32 beside its time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metainfer_gen.video.fuse import FuseKernelsConfig  # noqa: E402
from metainfer_gen.video.quality import psnr, ssim  # noqa: E402
from rounds import PSNR_CAP_DB, clip_psnr, round_robin  # noqa: E402  (benchmarks/ is on the path here)
from table import run_header, run_footer  # noqa: E402

POLICIES = ("off", "fbcache=0.05", "fbcache=0.1", "magcache", "taylorseer", "dbcache", "quality", "balanced", "fast")
# Random weights change less between steps than trained ones: thresholds tuned upstream skip nothing there.
RANDOM_POLICIES = ("off", "fbcache=0.1", "fbcache=0.2", "magcache", "taylorseer", "dbcache", "quality", "balanced",
                   "fast")
BASELINE_PREFIXES = ("off", "fbcache", "magcache", "taylorseer", "dbcache")
COLUMNS = ("setup", "policy", "blocks", "seconds", "speedup", "psnr_db", "psnr_worst_db", "ssim", "adherence")
# The kernels every row runs (--kernels fused): those outside the transformer blocks, which no cache skips.
OUTSIDE_BLOCKS = FuseKernelsConfig(adaln=False, qk_norm=False, rope=False)


def prompts_and_images(num_prompts: int, size: int, num_frames: int) -> list[tuple[str, np.ndarray, tuple]]:
    """Held-out demo prompts (never trained on) and a matching first frame for image-to-video."""
    import torch

    from demo_models.video.data import TEMPLATES, first_frame, held_out_combinations, sample_spec

    items = []
    for index, combo in enumerate(held_out_combinations()[:num_prompts]):
        colour, shape, direction = combo
        prompt = TEMPLATES[index % len(TEMPLATES)].format(colour=colour, shape=shape, direction=direction)
        spec = sample_spec(combo, num_frames, size, torch.Generator().manual_seed(10_000 + index))
        items.append((prompt, first_frame(spec, size), combo))
    return items


def adherence(frames: np.ndarray, combo: tuple) -> float:
    """Half a point each for the colour and the direction read back from the frames."""
    from demo_models.video.evaluate import read_clip

    reading = read_clip(frames)
    return 0.5 * (reading.colour == combo[0]) + 0.5 * (reading.direction == combo[2])


def decode_report(pipe, reference_dtype, fused: bool) -> str:
    """One line: the VAE decode's seconds in its dtype and in ``reference_dtype`` (a fresh copy loaded from the
    model folder or hub id, with the same kernels; best of 3, one random latent of the default clip) and the PSNR
    between the two decoded clips."""
    import time

    import torch

    from metainfer_gen.video.fuse import fuse_kernels
    from demo_models.video.data import to_uint8

    vae = pipe.diffusers_pipeline.vae
    latent = torch.randn(1, vae.config.z_dim, 5, pipe.default("height") // 4, pipe.default("width") // 4,
                         generator=torch.Generator().manual_seed(0))

    def decode(model) -> tuple[float, np.ndarray]:
        seconds = []
        with torch.no_grad():
            for _ in range(3):
                start = time.perf_counter()
                pixels = model.decode(latent.to(model.dtype)).sample
                seconds.append(time.perf_counter() - start)
        return min(seconds), to_uint8(pixels.float())

    other = type(vae).from_pretrained(str(pipe.source), subfolder="vae", torch_dtype=reference_dtype).eval()
    if fused:
        fuse_kernels(other, OUTSIDE_BLOCKS)
    fast, ours = decode(vae)
    slow, reference = decode(other)
    return (f"VAE decode ({latent.shape[2]} latent frames): {vae.dtype} {fast:.3f} s, {reference_dtype} {slow:.3f} s "
            f"({slow / fast:.2f}x), PSNR {psnr(ours, reference):.1f} dB against {reference_dtype}")


def large_random_pipeline(device: str, dtype, num_layers: int, width: int, vae: str = "tiny"):
    """A larger random-initialised Wan transformer (heads of 64) with the embedded text encoder, and either a tiny
    random Wan VAE (``vae="tiny"``: its decode costs a few transformer calls, so the transformer dominates the
    clip) or the embedded model's VAE (``"embedded"``: realistic pixels, but its decode is a large share)."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    from metainfer_gen.pipelines import TextToVideoPipeline
    from demo_models.video import configs

    small = TextToVideoPipeline.from_pretrained(None, device=device, torch_dtype=dtype)
    base = small.diffusers_pipeline
    torch.manual_seed(0)
    decoder = base.vae
    if vae == "tiny":
        decoder = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                   temperal_downsample=[True, True], latents_mean=[0.0] * 16, latents_std=[1.0] * 16,
                                   scale_factor_spatial=4, scale_factor_temporal=4).to(device, dtype).eval()
    heads = max(width // 64, 1)
    channels = decoder.config.z_dim  # the embedded VAE was retrained from 16 to 48 channels: follow it
    random = WanTransformer3DModel(**{**configs.TRANSFORMER_CONFIG, "num_layers": num_layers,
                                      "num_attention_heads": heads, "attention_head_dim": width // heads,
                                      "ffn_dim": 4 * width, "in_channels": channels, "out_channels": channels})
    with tempfile.TemporaryDirectory() as folder:  # from_pretrained keeps Wan's float32 modules in float32
        random.save_pretrained(folder)
        transformer = WanTransformer3DModel.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
    pipe = WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=decoder,
                       transformer=transformer, scheduler=base.scheduler, expand_timesteps=True)
    return TextToVideoPipeline(pipe, settings=small.settings, source="random-large")


def make_cache(spec: str, calibration):
    """A policy object for ``spec`` (made once per setup, so MagCache keeps its calibration between clips): ours
    with the calibration when one is given; ``"off"`` stays a string."""
    from metainfer_gen.video.cache.config import PRESETS, StepCacheConfig
    from metainfer_gen.video.cache.policies import make_policy, parse_spec
    from metainfer_gen.video.cache.policy import StepCachePolicy

    name, value = parse_spec(spec)
    if name == "off":
        return spec
    if calibration is None or (name not in PRESETS and name != "auto"):
        return make_policy(spec)
    overrides = {} if value is None else {"error_budget": value}
    config = StepCacheConfig.preset(name, signal=calibration.signal, calibration=calibration, **overrides)
    return StepCachePolicy(config, name=spec)


def render(pipe, task: str, cache, item, seed: int, call: dict):
    """One clip with ``cache`` enabled for just this call."""
    prompt, image, _ = item
    pipe.enable_step_cache(cache)
    try:
        return pipe(*((prompt,) if task == "t2v" else (image, prompt)), seed=seed, **call)
    finally:
        pipe.disable_step_cache()


def make_row(policy: str, outputs: list, reference: list | None, items, score: bool) -> dict:
    """Means per clip; PSNR (mean and worst clip), SSIM and speedup against the uncached clips of the same seeds."""
    row = {"policy": policy, "blocks": float(np.mean([o.stats.block_evaluations for o in outputs])),
           "seconds": float(np.mean([o.stats.seconds for o in outputs]))}
    if reference is None:
        row.update(psnr_db=PSNR_CAP_DB, psnr_worst_db=PSNR_CAP_DB, ssim=1.0, speedup=1.0)
    else:
        pairs = list(zip(outputs, reference))
        clips = [clip_psnr(o.frames, r.frames) for o, r in pairs]
        row["psnr_db"], row["psnr_worst_db"] = float(np.mean(clips)), float(np.min(clips))
        row["ssim"] = float(np.mean([ssim(o.frames, r.frames) for o, r in pairs]))
        row["speedup"] = float(np.mean([r.stats.seconds for r in reference])) / row["seconds"]
    row["adherence"] = float(np.mean([adherence(o.frames, c) for o, (_, _, c) in zip(outputs, items)])) \
        if score else None
    return row


def bench_setup(name: str, pipes: dict, tasks: list[str], policies: list[str], items, call: dict,
                score: bool, calibrate_on: str | None, repeats: int = 1) -> list[dict]:
    """All policies on each task of one model, round-robin per prompt (every policy sees the same machine load
    over the run); ``calibrate_on``: a prompt for our calibration (None: ours fits online); ``repeats``: clips per
    (policy, prompt), the fastest counts (outputs are identical: same seed)."""
    from metainfer_gen.video.cache.calibrate import calibrate

    calibration = None
    if calibrate_on is not None and any(not p.startswith(BASELINE_PREFIXES) for p in policies):
        rest = {k: v for k, v in call.items() if k != "num_inference_steps"}
        calibration = calibrate(pipes["t2v"], [calibrate_on], num_inference_steps=call["num_inference_steps"],
                                seed=10_000, **rest)
    rows = []
    for task in tasks:
        pipe = pipes[task]
        render(pipe, task, "off", items[0], 0, call)  # the first call of a process is slower; not timed

        def timed(cache):
            def run(index, item):
                if getattr(cache, "mag_ratios", False) is None:
                    render(pipe, task, cache, item, index, call)  # MagCache calibrates first; not timed
                return render(pipe, task, cache, item, index, call)
            return run

        outputs = round_robin({spec: timed(make_cache(spec, calibration)) for spec in policies}, items, repeats,
                              on_item=lambda index: print(f"{name} {task}: prompt {index + 1}/{len(items)} done",
                                                          file=sys.stderr, flush=True))
        reference = outputs[policies[0]] if policies[0] == "off" else None
        for spec in policies:
            row = make_row(spec, outputs[spec], reference, items, score)
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
    parser.add_argument("--setups", default="embedded,random", help="comma-separated: embedded, random (default both)")
    parser.add_argument("--model", default=None, help="pipeline folder (default: the embedded model)")
    parser.add_argument("--steps", type=int, default=50, help="num_inference_steps (default 50)")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts per task (default 8)")
    parser.add_argument("--tasks", default="t2v,i2v", help="embedded setup: comma-separated t2v, i2v (default both)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="embedded setup: comma-separated cache specs")
    parser.add_argument("--guidance-scale", type=float, default=None, help="CFG weight (model default if omitted)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--online", action="store_true", help="ours fits its ratios online (no calibration run)")
    parser.add_argument("--large-layers", type=int, default=4, help="blocks of the larger random Wan")
    parser.add_argument("--large-width", type=int, default=384, help="hidden size of the larger random Wan")
    parser.add_argument("--large-size", type=int, default=64, help="frame height and width on the larger model")
    parser.add_argument("--large-frames", type=int, default=5, help="frames on the larger model (4k+1)")
    parser.add_argument("--large-steps", type=int, default=30, help="steps on the larger model (default 30)")
    parser.add_argument("--large-guidance", type=float, default=1.0, help="CFG on the larger model (default 1: off)")
    parser.add_argument("--large-vae", choices=("tiny", "embedded"), default="tiny",
                        help="VAE of the larger model: a tiny random one (default) or the embedded one")
    parser.add_argument("--large-prompts", type=int, default=None, help="prompts on the larger model (default "
                        "--num-prompts)")
    parser.add_argument("--large-policies", default=",".join(RANDOM_POLICIES), help="random setup: cache specs")
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 frames at 32x32 (64x64 for SSIM)")
    parser.add_argument("--kernels", choices=("fused", "stock"), default="fused",
                        help="VAE convolutions and norms and the timestep embedding through the kernel registry "
                             "(default) or diffusers' own")
    parser.add_argument("--repeats", type=int, default=1,
                        help="clips per policy and prompt, round-robin; the fastest counts (default 1)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--vae-dtype", choices=("float32", "bfloat16"), default=None,
                        help="embedded setup: the VAE's dtype for every row (default: the pipeline's)")
    parser.add_argument("--embed-memo", choices=("on", "off"), default="on",
                        help="the lossless condition-embedder memo on every row (default on) or on none")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    print(run_header(), flush=True)
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")  # cache-dit logs to stdout, into the table

    from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline

    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    setups = [s for s in args.setups.split(",") if s]
    unknown = set(setups) - {"embedded", "random"}
    if unknown:
        parser.error(f"unknown setups {sorted(unknown)}; choose embedded, random")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    frames = 5 if args.quick else 17
    call = {"num_inference_steps": args.steps, "num_frames": frames}
    if args.guidance_scale is not None:
        call["guidance_scale"] = args.guidance_scale
    rows = []
    if "embedded" in setups:
        vae_dtype = getattr(torch, args.vae_dtype) if args.vae_dtype else None
        t2v = TextToVideoPipeline.from_pretrained(args.model, device=args.device, torch_dtype=dtype,
                                                  vae_dtype=vae_dtype)
        t2v.set_progress_bar_config(disable=True)
        if args.kernels == "fused":
            t2v.enable_fused_kernels(config=OUTSIDE_BLOCKS)
        if args.embed_memo == "on":
            t2v.enable_embed_memo()  # every row: the I2V pipeline below shares the transformer
        if vae_dtype not in (None, dtype):
            print(decode_report(t2v, dtype, args.kernels == "fused"), flush=True)
        size = t2v.default("height")
        items = prompts_and_images(args.num_prompts + 1, size, frames)
        rows += bench_setup("embedded" if args.model is None else Path(args.model).name,
                            {"t2v": t2v, "i2v": ImageToVideoPipeline.from_pipe(t2v)},
                            [t for t in args.tasks.split(",") if t], _available(args.policies), items[1:], call,
                            score=args.model is None, calibrate_on=None if args.online else items[0][0],
                            repeats=args.repeats)
    if "random" in setups:
        large = large_random_pipeline(args.device, dtype, args.large_layers, args.large_width, args.large_vae)
        large.set_progress_bar_config(disable=True)
        if args.kernels == "fused":
            large.enable_fused_kernels(config=OUTSIDE_BLOCKS)
        if args.embed_memo == "on":
            large.enable_embed_memo()
        large_size = 64 if args.quick else args.large_size
        large_call = {**call, "height": large_size, "width": large_size,
                      "num_frames": 5 if args.quick else args.large_frames,
                      "num_inference_steps": args.large_steps, "guidance_scale": args.large_guidance}
        items = prompts_and_images((args.large_prompts or args.num_prompts) + 1, large_size, large_call["num_frames"])
        rows += bench_setup(f"random-wan-{args.large_layers}x{args.large_width}", {"t2v": large}, ["t2v"],
                            _available(args.large_policies), items[1:], large_call, score=False,
                            calibrate_on=None if args.online else items[0][0], repeats=args.repeats)
    vae = args.vae_dtype or str(dtype).removeprefix("torch.")
    print(f"every row: embed memo {args.embed_memo}, kernels {args.kernels} outside the blocks, VAE {vae} "
          f"(embedded setup), {torch.get_num_threads()} threads, {args.steps} steps, {args.num_prompts} prompts, "
          f"fastest of {args.repeats} per clip; PSNR (dB) against the uncached clip: mean and worst clip")
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    print("\n".join(format_row(row) for row in rows))
    print(run_footer(time.perf_counter() - started))
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "clips"} for r in rows],
                                              indent=1, default=float))
    return 0


def _available(specs: str) -> list[str]:
    policies = [p for p in specs.split(",") if p]
    if not policies or policies[0] != "off":
        raise SystemExit(f"the policies must start with off (the reference of PSNR, SSIM and speedup): {specs}")
    if "dbcache" in policies and importlib.util.find_spec("cache_dit") is None:
        print("cache-dit not installed: dbcache row skipped (pip install cache-dit)", file=sys.stderr)
        policies.remove("dbcache")
    return policies


if __name__ == "__main__":
    sys.exit(main())
