"""Train the demo *style* LoRA: the same moving shapes, always on a navy background instead of a random dark tint.

The effect is measurable without a person: the border colour of the clips moves to the style's background at
weight 1.0 and stays where the base model puts it at weight 0.0, while prompt adherence (colour, direction) is
kept. Run on a pipeline folder (resumable: rerun the same command after a stop)::

    OMP_NUM_THREADS=2 python -m demo_models.video.train_style_lora build/demo_model/pipeline \
        --work-dir build/demo_model/style_lora --out build/demo_model/style_lora/style_lora.safetensors

Objective: rectified flow exactly as ``train_transformer`` (shifted uniform noise levels, the model predicts
``noise - x0``, one prompt in ten dropped for guidance), text-to-video clips only, on the LoRA parameters only.
Clips are procedural (``data.sample_spec``) with the background replaced by :data:`STYLE_BACKGROUND`; they are
encoded once to ``work_dir/latents.pt``. The end of the run writes the LoRA and ``work_dir/eval.json``.

By default the data and noise levels are the shipped transformer's own (centred starts, 70% of the clips at sigma
in [0.9, 1): see docs/demo_model.md). Trained on uncentred clips at the plain shifted draw instead
(``--no-centred-start --high-noise-fraction 0``), the LoRA reached the navy as well but took the direction from
where a clip starts again: direction accuracy 88% -> 67% at weight 1 on the 24 held-out prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import torch

from demo_models.video import lora_eval, lora_training
from demo_models.video.data import TEMPLATES, render_clip, sample_spec, to_uint8, training_combinations
from demo_models.video.train_transformer import prompt_table, shifted_sigmas

# Inside the base data's background range (each channel uniform in [0, 0.22]) so the VAE reproduces it: a light
# grey (0.85) came back from the VAE as (0.61, 0.64, 0.61), and the LoRA trained on it washed the shapes out
# (colour accuracy 96% -> 21% at weight 1).
STYLE_BACKGROUND = (0.0, 0.02, 0.22)


def styled_clips(num_clips: int, num_frames: int, size: int, seed: int,
                  centred: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Videos (N, 3, F, size, size) in [-1, 1] on the style background, and their prompt index (N,) into
    ``train_transformer.prompt_table`` (combination-major, template-minor). ``centred``: see ``data.sample_spec``."""
    generator = torch.Generator().manual_seed(seed)
    combos = training_combinations()
    videos, index = [], []
    for _ in range(num_clips):
        combo = int(torch.randint(len(combos), (), generator=generator))
        spec = dataclasses.replace(sample_spec(combos[combo], num_frames, size, generator, centred=centred),
                                   background=STYLE_BACKGROUND)
        videos.append(render_clip(spec, num_frames, size)[0])
        index.append(combo * len(TEMPLATES) + int(torch.randint(len(TEMPLATES), (), generator=generator)))
    return torch.stack(videos), torch.tensor(index)


@torch.no_grad()
def encoded_data(pipe, work_dir: Path, num_clips: int, num_frames: int, size: int, seed: int,
                 centred: bool = True) -> dict:
    """``{"latents", "prompt_index", "target_background", "centred"}``, encoded once and kept in
    ``work_dir/latents.pt``.

    Raises:
        ValueError: the work dir's latents were encoded with the other ``centred`` setting (use a new work dir).

    ``target_background`` is the border colour of the styled clips after a VAE round trip: what the style looks
    like through this model's VAE (a VAE with a colour cast shifts it), the colour the LoRA's output should reach.
    """
    path = work_dir / "latents.pt"
    if path.exists():
        data = torch.load(path, map_location="cpu")
        if data.get("centred", False) != centred:
            raise ValueError(f"{path} holds clips with centred={data.get('centred', False)}, not {centred}: pass "
                             f"a new --work-dir, or the setting those latents were encoded with")
        return data
    vae = pipe.diffusers_pipeline.vae
    videos, prompt_index = styled_clips(num_clips, num_frames, size, seed, centred)
    latents = lora_training.normalised_latents(vae, videos)
    decoded = vae.decode(vae.encode(videos[:4]).latent_dist.mode()).sample  # (4, 3, F, H, W) in [-1, 1]
    frames = to_uint8(decoded.permute(0, 2, 3, 4, 1))
    data = {"latents": latents, "prompt_index": prompt_index, "centred": centred,
            "target_background": lora_eval.background_colour(list(frames)).tolist()}
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.save(data, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    return data


def evaluate_style(pipe, lora_path: Path, target: list[float], num_prompts: int, seed: int = 0, **call) -> dict:
    """Background colour and adherence at LoRA weight 0.0 and 1.0 on held-out prompts (see module docstring)."""
    prompts = lora_eval.held_out_prompts(num_prompts)
    pipe.load_lora(lora_path, adapter_name="style", weight=0.0)
    result: dict = {"target_background": target}
    for weight in (0.0, 1.0):
        pipe.set_lora_weights({"style": weight})
        clips = lora_eval.render(pipe, prompts, seed, **call)
        background = lora_eval.background_colour(clips)
        result[f"weight_{weight:g}"] = {"background": background.round(4).tolist(),
                                        "distance_to_target": float(np.linalg.norm(background - target)),
                                        **lora_eval.adherence(clips, prompts)}
    pipe.unload_lora("style")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    lora_training.add_arguments(parser, "style_lora", steps=400, rank=8, lr=1e-3)
    parser.add_argument("--num-clips", type=int, default=512, help="procedural styled clips encoded for training")
    parser.add_argument("--eval-steps", type=int, default=None, help="denoising steps of the evaluation clips")
    parser.add_argument("--centred-start", action=argparse.BooleanOptionalAction, default=True,
                        help="clips start in the central box, as the shipped transformer's (data.sample_spec)")
    parser.add_argument("--high-noise-fraction", type=float, default=0.7,
                        help="share of clips at sigma in [0.9, 1), as the shipped transformer's last phases")
    args = parser.parse_args(argv)

    work_dir = Path(args.work_dir)
    pipe = lora_training.load_pipeline(args.model)
    frames, size = args.num_frames or pipe.default("num_frames"), args.size or pipe.default("height")
    data = encoded_data(pipe, work_dir, args.num_clips, frames, size, args.seed, args.centred_start)
    embeds, prompts = prompt_table(pipe.diffusers_pipeline, pipe.default("max_sequence_length"))
    shift = pipe.diffusers_pipeline.scheduler.config.shift

    def batch_loss(transformer, generator):
        index = torch.randint(len(data["latents"]), (args.batch_size,), generator=generator)
        x0, text = data["latents"][index], data["prompt_index"][index].clone()
        text[torch.rand(args.batch_size, generator=generator) < 0.1] = len(prompts) - 1
        sigma = shifted_sigmas(args.batch_size, shift, generator, args.high_noise_fraction)
        noise = torch.randn(x0.shape, generator=generator)
        xt = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
        pred = lora_training.predict_velocity(transformer, xt, sigma, embeds[text])
        return (pred - (noise - x0)).square().mean(), {}

    out = lora_training.train(pipe, args, batch_loss)
    call = {"num_frames": frames, "height": size, "width": size, "num_inference_steps": args.eval_steps}
    result = evaluate_style(pipe, out, data["target_background"], args.eval_prompts, **call) \
        if args.eval_prompts > 0 else {}
    (work_dir / "eval.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
