"""Train the demo model's Wan transformer with flow matching, then assemble the full diffusers pipeline.

Run after ``train_vae`` (resumable; rerun the same command after a stop)::

    OMP_NUM_THREADS=2 python -m demo_models.video.train_transformer \
        --vae-dir build/demo_model/vae/final --work-dir build/demo_model/transformer

Objective: rectified flow as in Wan 2.1 (Esser et al. 2024, "Scaling Rectified Flow Transformers"):
``x_s = (1 - s) x_0 + s * noise``, the model predicts ``noise - x_0`` at timestep ``1000 s``, with ``s`` drawn
uniformly and then shifted (shift 3, the scheduler's inference shift). Half of the clips are image-conditioned
as in Wan 2.2 TI2V: the first latent frame is the clean latent of the first video frame, its tokens get
timestep 0 and it is left out of the loss. One prompt in ten is dropped to "" for classifier-free guidance.
An exponential moving average of the weights (decay 0.999) is what ships.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from demo_models.video import components, configs
from demo_models.training import ResumableRun
from demo_models.video.data import TEMPLATES, training_combinations
from demo_models.video.latents import encode_shards, latent_statistics, load_shards


@torch.no_grad()
def prompt_table(pipe, text_length: int = 512) -> tuple[torch.Tensor, list[str]]:
    """Embeddings (P + 1, text_length, text_dim) of every training prompt (combo-major, template-minor), then "".

    Past each prompt's tokens the pipeline pads with zero rows up to ``text_length`` (``max_sequence_length``), and
    Wan's cross-attention has no mask, so the padding takes a share of every attention softmax."""
    prompts = [t.format(colour=c, shape=s, direction=d) for c, s, d in training_combinations() for t in TEMPLATES]
    prompts.append("")
    embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=text_length,
                                   device=torch.device("cpu"))
    return embeds, prompts


def shifted_sigmas(batch: int, shift: float, generator: torch.Generator, high_noise_fraction: float = 0.0,
                   high_noise_floor: float = 0.9) -> torch.Tensor:
    """Noise levels in [0, 1): ``shift * u / (1 + (shift - 1) * u)`` of a uniform ``u`` (SD3/Wan timestep shift);
    a ``high_noise_fraction`` of them is instead uniform in ``[high_noise_floor, 1)``, the levels at which the
    noisy latent barely shows the object's path, so only the prompt can (see ``demo_model.diagnose``)."""
    u = torch.rand(batch, generator=generator)
    sigma = shift * u / (1 + (shift - 1) * u)
    if high_noise_fraction <= 0:  # draws nothing more: the default recipe's batches stay as they were
        return sigma
    high = torch.rand(batch, generator=generator) < high_noise_fraction
    floor = high_noise_floor + (1 - high_noise_floor) * torch.rand(batch, generator=generator)
    return torch.where(high, floor, sigma)


def path_weight(x0: torch.Tensor, weight: float, floor: float = 0.2, ramp: float = 0.3) -> torch.Tensor:
    """Per-position loss weight (N, 1, 1, h, w) that is ``1 + weight`` on the object's path and 1 elsewhere.

    ``x0``: normalised clean latents (N, z, F', h, w). The clips have a flat background, so a latent position is the
    object's where its channel vector is far from the frame's per-channel spatial median; the distance is scaled to
    the frame's largest, mapped to [0, 1] by a ramp from ``floor`` to ``floor + ramp`` (the VAE's border ring, about
    a fifth of the object's distance, stays out), and the maximum over frames is the path: every position the object
    crosses in the clip. The weight makes "where along its path the object is at each frame", which the direction
    word decides, count as much as the background it otherwise shares the loss with (about 10% of the positions
    hold the object). ``weight=0`` returns ones (the plain flow-matching loss)."""
    if weight <= 0:
        return torch.ones(x0.shape[0], 1, 1, *x0.shape[3:])
    distance = (x0 - x0.flatten(3).median(dim=3).values[..., None, None]).norm(dim=1)  # (N, F', h, w)
    scaled = distance / distance.flatten(2).amax(dim=2).clamp_min(1e-6)[..., None, None]
    on_path = ((scaled - floor) / ramp).clamp(0, 1).amax(dim=1)  # (N, h, w)
    return 1 + weight * on_path[:, None, None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae-dir", default="build/demo_model/vae/final", help="trained VAE (save_pretrained dir)")
    parser.add_argument("--work-dir", default="build/demo_model/transformer", help="checkpoint and log folder")
    parser.add_argument("--out-dir", default="build/demo_model/pipeline", help="where the assembled pipeline goes")
    parser.add_argument("--num-clips", type=int, default=2048, help="procedural clips encoded for training")
    parser.add_argument("--steps", type=int, default=1800, help="total optimiser steps")
    parser.add_argument("--batch-size", type=int, default=16, help="clips per step")
    parser.add_argument("--lr", type=float, default=5e-4, help="peak AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and batches")
    parser.add_argument("--high-noise-fraction", type=float, default=0.0,
                        help="share of clips trained at noise levels in [0.9, 1) on top of the shifted draw")
    parser.add_argument("--image-fraction", type=float, default=0.5,
                        help="share of clips conditioned on their clean first latent frame (image-to-video)")
    parser.add_argument("--path-weight", type=float, default=0.0,
                        help="extra loss weight on the positions the object crosses (see path_weight; 0: plain)")
    parser.add_argument("--trail", type=int, default=0,
                        help="fading copies behind each training shape (data.ClipSpec.trail; 0: the shipped data)")
    parser.add_argument("--centred-start", action="store_true",
                        help="start every clip in the central box (data.sample_spec centred): the start says nothing "
                             "about the direction")
    parser.add_argument("--init-from", default=None,
                        help="start from the transformer of this pipeline folder (fine-tuning; fresh optimiser)")
    parser.add_argument("--attention-head-dim", type=int, default=configs.TRANSFORMER_CONFIG["attention_head_dim"],
                        help="per-head width (heads = inner width / this); wider heads get more RoPE frequencies")
    parser.add_argument("--patch-size", type=int, default=configs.TRANSFORMER_CONFIG["patch_size"][1],
                        help="spatial patch (height = width) of a transformer token, in latent pixels")
    parser.add_argument("--num-attention-heads", type=int, default=None,
                        help="heads (default: the shipped inner width / --attention-head-dim)")
    parser.add_argument("--ffn-dim", type=int, default=configs.TRANSFORMER_CONFIG["ffn_dim"],
                        help="feed-forward width")
    parser.add_argument("--text-length", type=int, default=configs.TEXT_MAX_LENGTH,
                        help="max_sequence_length of the prompt embeddings (real tokens + zero padding); the "
                             "shipped model: 16 (512, diffusers' Wan default, halved its direction accuracy)")
    args = parser.parse_args(argv)

    from diffusers import AutoencoderKLWan

    work_dir = Path(args.work_dir)
    vae = AutoencoderKLWan.from_pretrained(args.vae_dir).eval().requires_grad_(False)
    data = load_shards(encode_shards(vae, work_dir, args.num_clips, trail=args.trail,
                                          centred=args.centred_start))
    mean, std = latent_statistics(data["latents"], work_dir)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    latents = (data["latents"] - torch.tensor(mean).view(1, -1, 1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1, 1)
    prompt_index = data["combo"] * len(TEMPLATES) + data["template"]

    inner = configs.TRANSFORMER_CONFIG["num_attention_heads"] * configs.TRANSFORMER_CONFIG["attention_head_dim"]
    heads = args.num_attention_heads or inner // args.attention_head_dim
    transformer = components.build_transformer(args.seed, attention_head_dim=args.attention_head_dim,
                                               num_attention_heads=heads, ffn_dim=args.ffn_dim,
                                               patch_size=(1, args.patch_size, args.patch_size))
    if args.init_from:
        from diffusers import WanTransformer3DModel

        transformer.load_state_dict(WanTransformer3DModel.from_pretrained(Path(args.init_from) / "transformer")
                                    .state_dict())
    pipe = components.assemble_pipeline(vae, transformer)
    embeds, prompts = prompt_table(pipe, args.text_length)
    ema = copy.deepcopy(transformer).requires_grad_(False)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    run = ResumableRun(work_dir, transformer, optimizer)
    ema_path = work_dir / "ema.pt"
    if ema_path.exists():
        ema.load_state_dict(torch.load(ema_path, map_location="cpu"))
    transformer.train()
    _, _, num_lat_frames, height, width = latents.shape
    tokens_per_frame = (height // args.patch_size) * (width // args.patch_size)
    while run.step < args.steps:
        run.set_learning_rate(args.lr, args.steps, warmup_steps=200)
        generator = run.generator(args.seed)
        index = torch.randint(len(latents), (args.batch_size,), generator=generator)
        x0 = latents[index]
        text = prompt_index[index].clone()
        text[torch.rand(args.batch_size, generator=generator) < 0.1] = len(prompts) - 1
        sigma = shifted_sigmas(args.batch_size, configs.SCHEDULER_CONFIG["shift"], generator,
                               args.high_noise_fraction)
        noise = torch.randn(x0.shape, generator=generator)
        xt = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
        conditioned = torch.rand(args.batch_size, generator=generator) < args.image_fraction
        frame_weight = torch.ones(args.batch_size, 1, num_lat_frames, 1, 1)
        frame_weight[conditioned, :, 0] = 0.0
        xt = frame_weight * xt + (1 - frame_weight) * x0
        timestep = (frame_weight[:, 0, :, 0, 0].repeat_interleave(tokens_per_frame, dim=1)) * sigma.view(-1, 1) * 1000
        pred = transformer(xt, timestep, embeds[text], return_dict=False)[0]
        weight = frame_weight * path_weight(x0, args.path_weight)
        loss = ((pred - (noise - x0)).square() * weight).sum() / (weight.sum() * pred.shape[1])
        run.optimizer_step(loss)
        with torch.no_grad():
            beta = min(0.999, run.step / (9 + run.step))  # (1 + s) / (10 + s) of the step just taken
            for e, p in zip(ema.parameters(), transformer.parameters()):
                e.lerp_(p, 1 - beta)
        if run.step % 25 == 0:
            run.log(loss=round(loss.item(), 5), lr=round(optimizer.param_groups[0]["lr"], 7))
        if run.step % 200 == 0 or run.step == args.steps:
            torch.save(ema.state_dict(), str(ema_path) + ".tmp")
            Path(str(ema_path) + ".tmp").replace(ema_path)
            run.maybe_save(force=True)
    final = components.assemble_pipeline(vae, ema.eval(), text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)
    components.save_pipeline(final, args.out_dir)
    # Call defaults, so the folder renders as it trained (17 frames of 64x64, not Wan's 81 of 480x832), with the
    # prompt-embedding length the transformer reads.
    from metainfer_gen.pipelines.loading import SETTINGS_FILE
    from demo_models.video.build import DEFAULT_SETTINGS

    settings = dict(DEFAULT_SETTINGS, max_sequence_length=args.text_length)
    (Path(args.out_dir) / SETTINGS_FILE).write_text(json.dumps(settings, indent=1) + "\n")
    print(f"saved {args.out_dir}", flush=True)


if __name__ == "__main__":
    main()
