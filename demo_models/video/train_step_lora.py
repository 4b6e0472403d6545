"""Train the demo *step-reduction* LoRA: 4-8 steps without guidance that follow the 30-step guided model.

Distillation along the teacher's own trajectories. The teacher (the base pipeline at ``--teacher-steps`` with its
default guidance) denoises seeded noise for training prompts; every latent it passes through is kept. An Euler
trajectory is piecewise linear in the noise level sigma, so the teacher's latent at any sigma of a K-step student
schedule is an exact interpolation between two kept latents. The student (base + LoRA, one unguided call per
step) learns, for each segment ``s_a -> s_b`` of its schedules, the velocity that lands one Euler step from the
teacher's latent at ``s_a`` on the teacher's latent at ``s_b``: ``v* = (x(s_b) - x(s_a)) / (s_b - s_a)``. Both
guidance (2 calls per step) and steps are distilled: 30 guided steps (60 calls) become 4-8 calls.

    OMP_NUM_THREADS=2 python -m demo_models.video.train_step_lora build/demo_model/pipeline \
        --work-dir build/demo_model/step_lora --out build/demo_model/step_lora/step_lora.safetensors

Resumable: teacher trajectories are written in atomic shards (``work_dir/teacher/``), training state by
``ResumableRun``. The end of the run writes the LoRA and ``work_dir/eval.json`` (adherence of the teacher and of
the student at each step count, PSNR/SSIM of the student against the teacher's clip of the same seed).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from demo_models.video import lora_eval, lora_training
from demo_models.video.train_transformer import prompt_table

SHARD = 16


def schedule(pipe, steps: int) -> torch.Tensor:
    """The sigmas (steps + 1,) the pipeline's scheduler visits in a ``steps``-step call, 1 -> 0."""
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float()


def at_sigmas(trajectory: torch.Tensor, sigmas: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Latents (B, Q, ...) at ``queries`` from a trajectory (B, T + 1, ...) kept at descending ``sigmas``, by
    linear interpolation in sigma (exact for Euler trajectories)."""
    ascending = sigmas.flip(0)
    upper = torch.searchsorted(ascending, queries).clamp(1, len(sigmas) - 1)  # ascending[upper-1] < q <= [upper]
    hi, lo = len(sigmas) - 1 - upper, len(sigmas) - upper  # indices into the descending trajectory
    weight = ((sigmas[hi] - queries) / (sigmas[hi] - sigmas[lo])).view(1, -1, *([1] * (trajectory.dim() - 2)))
    return trajectory[:, hi] + weight * (trajectory[:, lo] - trajectory[:, hi])


@torch.no_grad()
def teacher_shards(pipe, work_dir: Path, args, num_prompts: int, student_steps: list[int]) -> dict:
    """Teacher latents at every student schedule: ``{"prompt_index": (N,), "K<k>": (N, k + 1, z, F', h, w)}``.

    The teacher is the model as its settings file runs it: at its ``max_sequence_length`` (16 prompt rows for the
    embedded model, not diffusers' 512, which that model never saw and which cost it most of its direction reading).
    """
    diffusers_pipe = pipe.diffusers_pipeline
    _, prompts = prompt_table(diffusers_pipe)
    teacher_sigmas = schedule(diffusers_pipe, args.teacher_steps)
    shard_dir = work_dir / "teacher"
    shard_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    for index in range((num_prompts + SHARD - 1) // SHARD):
        path = shard_dir / f"shard_{index:04d}.pt"
        if not path.exists():
            generator = torch.Generator().manual_seed(args.seed * 1_000_003 + index)
            chosen = torch.randint(len(prompts) - 1, (SHARD,), generator=generator)  # never the empty prompt
            transformer = diffusers_pipe.transformer
            z, scale = transformer.config.in_channels, diffusers_pipe.vae_scale_factor_spatial
            frames = (args.num_frames - 1) // diffusers_pipe.vae_scale_factor_temporal + 1
            noise = torch.randn(SHARD, z, frames, args.size // scale, args.size // scale, generator=generator)
            kept = [noise]
            diffusers_pipe([prompts[i] for i in chosen], num_frames=args.num_frames, height=args.size,
                           width=args.size, num_inference_steps=args.teacher_steps, guidance_scale=args.guidance,
                           max_sequence_length=pipe.default("max_sequence_length"), latents=noise.clone(),
                           output_type="latent",
                           callback_on_step_end=lambda p, i, t, kw: kept.append(kw["latents"].clone()) or kw)
            trajectory = torch.stack(kept, dim=1)  # (SHARD, T + 1, z, F', h, w)
            shard = {"prompt_index": chosen}
            shard.update({f"K{k}": at_sigmas(trajectory, teacher_sigmas, schedule(diffusers_pipe, k))
                          for k in student_steps})
            torch.save(shard, str(path) + ".tmp")
            os.replace(str(path) + ".tmp", path)
            print(f"teacher {path.name}", flush=True)
        shards.append(torch.load(path, map_location="cpu"))
    return {key: torch.cat([s[key] for s in shards]) for key in shards[0]}


def evaluate_steps(pipe, lora_path: Path, args, student_steps: list[int]) -> dict:
    """Adherence and time of the teacher, and of the base and the LoRA at each student step count (guidance 1).

    The base rows are the baseline the LoRA must beat: the same unguided few-step call without the adapter.
    """
    prompts = lora_eval.held_out_prompts(args.eval_prompts)
    call = {"num_frames": args.num_frames, "height": args.size, "width": args.size}
    started = time.perf_counter()
    teacher = lora_eval.render(pipe, prompts, num_inference_steps=args.teacher_steps, guidance_scale=args.guidance,
                               **call)
    rows = [{"name": f"base {args.teacher_steps} steps", "seconds": time.perf_counter() - started,
             **lora_eval.adherence(teacher, prompts)}]

    def few_step_rows(name: str) -> list[dict]:
        out = []
        for steps in student_steps:
            started = time.perf_counter()
            clips = lora_eval.render(pipe, prompts, num_inference_steps=steps, guidance_scale=1.0, **call)
            out.append({"name": f"{name} {steps} steps", "seconds": time.perf_counter() - started,
                        **lora_eval.adherence(clips, prompts), **lora_eval.fidelity(clips, teacher)})
        return out

    base = few_step_rows("base unguided")
    pipe.load_lora(lora_path, adapter_name="steps")
    lora = few_step_rows("step LoRA")
    pipe.unload_lora("steps")
    rows += lora + base
    worst = max(rows[0]["score"] - row["score"] for row in lora)
    return {"rows": rows, "worst_score_drop": worst, "within_5_points": worst <= 5}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    lora_training.add_arguments(parser, "step_lora", steps=600, rank=16, lr=5e-4)
    parser.add_argument("--teacher-steps", type=int, default=30, help="denoising steps of the teacher")
    parser.add_argument("--student-steps", default="4,6,8", help="comma-separated step counts the LoRA serves")
    parser.add_argument("--guidance", type=float, default=None, help="teacher guidance (default: the model's)")
    parser.add_argument("--num-prompts", type=int, default=128, help="teacher trajectories (rounded up to 16s)")
    args = parser.parse_args(argv)

    work_dir = Path(args.work_dir)
    pipe = lora_training.load_pipeline(args.model)
    args.num_frames, args.size = args.num_frames or pipe.default("num_frames"), args.size or pipe.default("height")
    args.guidance = args.guidance if args.guidance is not None else pipe.default("guidance_scale")
    student_steps = [int(k) for k in args.student_steps.split(",")]
    data = teacher_shards(pipe, work_dir, args, args.num_prompts, student_steps)
    embeds, _ = prompt_table(pipe.diffusers_pipeline, pipe.default("max_sequence_length"))
    sigmas = {k: schedule(pipe.diffusers_pipeline, k) for k in student_steps}

    def batch_loss(transformer, generator):
        k = student_steps[int(torch.randint(len(student_steps), (), generator=generator))]
        clip = torch.randint(len(data["prompt_index"]), (args.batch_size,), generator=generator)
        segment = torch.randint(k, (args.batch_size,), generator=generator)
        x_a, x_b = data[f"K{k}"][clip, segment], data[f"K{k}"][clip, segment + 1]
        s_a, s_b = sigmas[k][segment], sigmas[k][segment + 1]
        target = (x_b - x_a) / (s_b - s_a).view(-1, 1, 1, 1, 1)
        pred = lora_training.predict_velocity(transformer, x_a, s_a, embeds[data["prompt_index"][clip]])
        return (pred - target).square().mean(), {"steps": k}

    out = lora_training.train(pipe, args, batch_loss)
    result = evaluate_steps(pipe, out, args, student_steps) if args.eval_prompts > 0 else {}
    (work_dir / "eval.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
