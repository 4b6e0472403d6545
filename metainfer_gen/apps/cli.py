"""The ``metainfer-gen`` command line: one console script, one subcommand per job.

    metainfer-gen render "a red circle moving right" -o clip.mp4
    metainfer-gen render "the blue square moves up" --image first_frame.png -o clip.mp4
    metainfer-gen render --prompts prompts.jsonl --out-dir clips/
    torchrun --nproc-per-node 2 -m metainfer_gen.apps.cli render --prompts prompts.jsonl   # prompts split by rank
    torchrun --nproc-per-node 2 -m metainfer_gen.apps.cli render "a red circle" --cfg-parallel -o clip.mp4
    metainfer-gen demo                      # the Gradio demo on http://127.0.0.1:7860
    metainfer-gen calibrate --model DIR     # the step cache's signal-to-error mapping, stored beside the model
    metainfer-gen serve                     # OpenAI-compatible LLM + /v1/videos server on http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from metainfer_gen import __version__
from metainfer_gen.apps.arg_types import finite_fps, guidance, positive_int
from metainfer_gen.apps.fleet_args import add_job_store_arguments
from metainfer_gen.apps.video_args import add_video_model_arguments, apply_model_options, load_options



def _cache_spec(text: str) -> str:
    """Validate a ``--cache`` spec completely (name and value, e.g. ``auto=-1``) before any model is loaded."""
    from metainfer_gen.video.cache.policies import make_policy

    try:
        make_policy(text)
    except (ValueError, ImportError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return text


def _add_render_parser(subparsers) -> None:
    p = subparsers.add_parser("render", help="render a clip from a prompt, or a batch from a prompt file",
                              description="Render clips on the embedded default model or any diffusers video "
                                          "pipeline folder / hub id.")
    p.add_argument("prompt", nargs="?", default=None, help="text prompt (omit when using --prompts)")
    p.add_argument("-o", "--output", default="clip.mp4", help="output file: .mp4, .gif, or a name without suffix "
                                                               "for a folder of PNG frames (default: clip.mp4)")
    p.add_argument("--prompts", default=None, help="prompt file (JSON lines or plain text) for batch rendering")
    p.add_argument("--out-dir", default="clips", help="batch output folder with manifest.jsonl (default: clips)")
    p.add_argument("--format", choices=("mp4", "gif", "png"), default="mp4", help="batch clip format (default mp4)")
    p.add_argument("--image", default=None, help="reference image (first frame) for image-to-video")
    p.add_argument("--model", default=None, help="diffusers pipeline folder or hub id (default: embedded model)")
    p.add_argument("--negative-prompt", default=None, help="what to steer away from")
    p.add_argument("--num-frames", type=int, default=None, help="frames to render (model default if omitted)")
    p.add_argument("--height", type=int, default=None, help="height in pixels (model default if omitted)")
    p.add_argument("--width", type=int, default=None, help="width in pixels (model default if omitted)")
    p.add_argument("--steps", "--num-inference-steps", dest="num_inference_steps", type=positive_int, default=None,
                   help="num_inference_steps (model default if omitted)")
    p.add_argument("--guidance-scale", type=guidance, default=None, help="classifier-free guidance (1 disables)")
    p.add_argument("--seed", type=int, default=0, help="seed; in batches, line i without a seed uses seed+i")
    p.add_argument("--fps", type=finite_fps, default=None, help="frames per second of the written clip (> 0)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    add_video_model_arguments(p)
    p.add_argument("--cache", type=_cache_spec, default="off",
                   help="step cache: auto (ours, balanced), quality, fast, auto=BUDGET, or a baseline: fbcache, "
                        "magcache, taylorseer, dbcache (name=value sets its threshold); off disables (default)")
    p.add_argument("--cache-calibration", default=None, metavar="PATH",
                   help="step_cache_calibration.json from 'metainfer-gen calibrate' for our cache (default: the "
                        "file beside the model when present, else ratios fitted online)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:WEIGHT]",
                   help="LoRA file or folder, optional weight (default 1.0); repeat for several. A prompt-file line's "
                        "'lora' field replaces these for that line")
    p.add_argument("--cfg-parallel", action="store_true",
                   help="under torchrun (even number of ranks): each pair of ranks computes the conditional and "
                        "unconditional passes of a clip side by side; with --prompts the pairs split the file")
    p.add_argument("--context-parallel", type=positive_int, default=None, metavar="N",
                   help="under torchrun: split each clip's video tokens over N ranks (Ulysses attention); with "
                        "--cfg-parallel a clip takes 2 x N ranks; with --prompts the groups split the file")
    p.add_argument("--audit", action="store_true", help="print which kernel paths ran and why faster ones were refused")
    add_job_store_arguments(p, role="render")
    p.set_defaults(func=cmd_render)


def _add_doctor_parser(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="show this machine's capabilities and which fast kernel paths run here",
                              description="Print device kind, compute capability, bf16/fp8 support, peer access, "
                                          "Triton mode and package versions, then for each registered kernel op "
                                          "the implementation that would run here and why faster ones are refused.")
    p.add_argument("--strict", action="store_true", help="exit 1 if any op falls back from its fastest path")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    p.add_argument("--device", default=None, help="device of the example inputs: cpu, cuda (default: cuda if "
                                                   "available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="dtype of the example inputs (default: the LLM engine's run dtype here, bfloat16 "
                        "where the hardware multiplies it natively, else float32)")
    p.add_argument("--model", default=None,
                   help="a checkpoint directory or config .json: also print the attention path the LLM engine "
                        "runs for it and what it refuses, with why (reads the config only; default: none)")

    def cmd_doctor(args: argparse.Namespace) -> int:
        from metainfer_gen.apps.doctor import cmd_doctor as run

        return run(args)

    p.set_defaults(func=cmd_doctor)


def _call_args(args: argparse.Namespace) -> dict[str, Any]:
    names = ("negative_prompt", "num_frames", "height", "width", "num_inference_steps", "guidance_scale")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _pipeline_factory(args: argparse.Namespace) -> Callable[[str], Any]:
    """task -> pipeline, loading the weights once and sharing them between tasks where the model allows."""
    from metainfer_gen import pipelines

    classes = {"text-to-video": pipelines.TextToVideoPipeline, "image-to-video": pipelines.ImageToVideoPipeline}
    loaded: dict[str, Any] = {}
    options = load_options(args)

    def get(task: str):
        if task not in loaded:
            cls = classes[task]
            other = next(iter(loaded.values()), None)
            pipe = None
            if other is not None:
                try:
                    pipe = cls.from_pipe(other)
                except ValueError:
                    pipe = None
            # Cached only once loaded: a failed load is retried (and reports its own error) for the next clip.
            if pipe is None:
                pipe = cls.from_pretrained(args.model, device=args.device, **options)
                apply_model_options(pipe, args)
                if args.cache != "off" or not args.preset:  # an asked cache replaces the preset's
                    pipe.disable_step_cache()
                    pipe.enable_step_cache(args.cache, calibration=args.cache_calibration)
                if args.context_parallel:
                    pipe.enable_context_parallel(args.context_parallel, cfg_parallel=args.cfg_parallel)
                elif args.cfg_parallel:
                    pipe.enable_cfg_parallel()
            loaded[task] = pipe
        return loaded[task]

    return get


def cmd_render(args: argparse.Namespace) -> int:
    from metainfer_gen.kernels import audit

    with audit() as report:
        code = _render(args)
    if args.audit and os.environ.get("RANK", "0") == "0":
        print(report.summary() if report.num_calls else "kernel audit: no registry kernel ran "
              "(enable them with --fused-kernels)")
    return code


def _start_ranks(args: argparse.Namespace):
    """Under torchrun (WORLD_SIZE > 1): the collectives and this rank's device; None in a single process."""
    from metainfer_gen.collectives import launched_world_size

    if launched_world_size() == 1:
        if args.context_parallel:
            raise ValueError(f"--context-parallel {args.context_parallel} splits a clip over several ranks: launch "
                             f"with torchrun --nproc-per-node {args.context_parallel * (1 + args.cfg_parallel)}")
        return None
    from metainfer_gen.apps.render_ranks import RenderRanks

    ranks = RenderRanks.start(cfg_parallel=args.cfg_parallel, context_parallel=args.context_parallel or 1)
    if args.prompts is None and ranks.dp_size > 1:
        per_clip = (1 + args.cfg_parallel) * (args.context_parallel or 1)
        raise ValueError(f"one clip under torchrun uses {per_clip} rank(s) (--cfg-parallel: 2, --context-parallel "
                         f"N: N); got {ranks.state.world_size} ranks: use --prompts FILE to split a batch over more")
    if args.device is None:
        args.device = str(ranks.state.device)  # NCCL: each rank its own GPU
    return ranks


def _render(args: argparse.Namespace) -> int:
    from metainfer_gen.apps.render import RenderJob, parse_lora_spec, parse_prompt_file, render_batch, use_loras
    from metainfer_gen.video.export import check_output_path
    from metainfer_gen.pipelines.loading import default_model_path
    from metainfer_gen.video.rules import VideoRules, check_prompts

    if (args.prompt is None) == (args.prompts is None):
        raise ValueError("give either a PROMPT or --prompts FILE (exactly one)")
    loras = [parse_lora_spec(spec) for spec in args.lora]  # a missing file fails here, before any loading
    if args.job_store is not None:  # the batch goes to a fleet's shared queue (apps/render_fleet.py)
        from metainfer_gen.apps.render_fleet import run_fleet_render

        if args.prompts is None:
            raise ValueError("--job-store renders a batch through the fleet: give --prompts FILE")
        return run_fleet_render(args, parse_prompt_file(args.prompts, args.seed, _call_args(args), loras=loras))
    ranks = _start_ranks(args)
    main_rank = ranks is None or ranks.is_main
    get_pipeline = _pipeline_factory(args)
    if args.prompts:
        jobs = parse_prompt_file(args.prompts, base_seed=args.seed, defaults=_call_args(args), loras=loras)
        summary = render_batch(jobs, args.out_dir, get_pipeline, fmt=args.format, fps=args.fps, progress=main_rank,
                               shard=None if ranks is None else ranks.shard())
        totals = summary.to_dict() if ranks is None else ranks.totals(summary)
        if main_rank:
            print(json.dumps(totals))
        if ranks is not None:
            ranks.close()
        return 0 if totals["failed"] == 0 else 1
    if args.image is not None and not Path(args.image).exists():
        raise FileNotFoundError(f"--image {args.image} does not exist")
    check_output_path(args.output)
    check_prompts(args.prompt)
    rules = VideoRules.from_model_dir(args.model or default_model_path())  # a Wan folder's rules, from its configs
    if rules is not None:  # so a bad size fails before the load; other models are checked once loaded
        rules.check_sizes(num_frames=args.num_frames, height=args.height, width=args.width)
    job = RenderJob(line=0, prompt=args.prompt, seed=args.seed, image=args.image, call=_call_args(args))
    pipe = get_pipeline("text-to-video" if job.image is None else "image-to-video")
    for report in use_loras(pipe, loras):
        if main_rank:
            print(report.summary())
    if job.image is None:
        output = pipe(job.prompt, seed=job.seed, **job.call)
    else:
        output = pipe(job.image, job.prompt, seed=job.seed, **job.call)
    if not main_rank:  # the CFG partner or CP peers computed their part; rank 0 writes the clip
        return 0
    path = output.save(args.output, fps=args.fps)
    stats = output.stats
    cache = stats.cache
    reused = f", cache {cache['policy']}: {cache.get('num_reused', '?')} calls reused" if cache else ""
    print(f"wrote {path} ({output.frames.shape[0]} frames, {output.frames.shape[2]}x{output.frames.shape[1]}) in "
          f"{stats.seconds:.1f} s; {stats.transformer_calls} transformer calls, "
          f"{stats.block_evaluations} block evaluations{reused}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metainfer-gen", description="Fast video and LLM inference toolkit.")
    parser.add_argument("--version", action="version", version=f"metainfer-gen {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_render_parser(subparsers)
    _add_doctor_parser(subparsers)
    from metainfer_gen.apps.generate import add_generate_parser

    add_generate_parser(subparsers)
    from metainfer_gen.apps.demo import add_demo_parser

    add_demo_parser(subparsers)
    from metainfer_gen.apps.calibrate_cmd import add_calibrate_parser

    add_calibrate_parser(subparsers)
    from metainfer_gen.apps.plan_cmd import add_plan_parser

    add_plan_parser(subparsers)
    from metainfer_gen.apps.serve_cmd import add_serve_parser

    add_serve_parser(subparsers)
    from metainfer_gen.apps.video_worker_cmd import add_video_worker_parser

    add_video_worker_parser(subparsers)
    return parser


def _check_device(device: str | None) -> None:
    """Refuse a device this machine cannot use before anything loads.

    Raises:
        ValueError: an unparsable device string, or CUDA asked for where torch sees no CUDA device.
    """
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} asked for CUDA, but this torch build sees no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu or install a CUDA build of torch")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the process exit code. Run as a command (``argv`` None), it first re-executes
    itself once under the fast host allocator (:mod:`metainfer_gen.host_allocator`; ``METAINFER_HOST_ALLOCATOR=system``
    keeps the environment as it is)."""
    if argv is None:
        from metainfer_gen import host_allocator

        host_allocator.reexec()
    args = build_parser().parse_args(argv)
    try:
        _check_device(getattr(args, "device", None))
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
