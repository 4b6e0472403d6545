"""Train the demo model's causal 3D VAE (diffusers ``AutoencoderKLWan``) from scratch on procedural clips.

Run (resumable; rerun the same command after a stop)::

    OMP_NUM_THREADS=2 python -m demo_models.video.train_vae --work-dir build/demo_model/vae

Schedule: single frames first, then 9-frame clips, both on random 32x32 crops (4x cheaper; the VAE is convolutional),
then full 64x64 clips. Loss: mask-weighted MSE (+0.1 L1) in pixel space (the shape's pixels weigh 4x, so small saturated
objects keep their colour) plus a small KL term (Kingma & Welling 2014) that keeps the latent well scaled.
"""

from __future__ import annotations

import argparse
import math

import torch

from demo_models.video import configs
from demo_models.training import ResumableRun
from demo_models.video.data import held_out_combinations, sample_batch


def build_vae():
    """A fresh VAE whose posterior starts nearly deterministic (log-variance bias -8, std 0.02).

    With diffusers' default init the posterior std is ~1 against latent means of ~0.2, so the decoder first sees
    mostly noise and training sits on a plateau (predicting the background) for hundreds of steps.
    """
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**configs.VAE_CONFIG)
    with torch.no_grad():
        vae.quant_conv.bias[configs.Z_DIM:] = -8.0
    return vae


@torch.no_grad()
def make_temporal_paths_identity(vae) -> None:
    """Make every temporal operation of the VAE pass single frames through, before the clip phase.

    Single-frame training only ever trains the last (current-frame) tap of each causal 3D convolution, because the
    earlier taps see the causal zero padding, and it never runs the resampling blocks' ``time_conv``. Left at
    their random initial values these turned a 27.7 dB single-frame model into a 14 dB clip model at the first
    clip step. Zeroing the earlier taps makes each causal conv act frame by frame (so every frame starts at the
    single-frame quality); the temporal downsampling conv is set to pick the newer frame of each pair and the
    upsampling conv to duplicate its frame. The clip phase then learns only what motion adds.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResample

    for module in vae.modules():
        if isinstance(module, WanResample) and hasattr(module, "time_conv"):
            conv = module.time_conv
            conv.weight.zero_()
            conv.bias.zero_()
            out_channels, in_channels = conv.weight.shape[:2]
            eye = torch.eye(in_channels, dtype=conv.weight.dtype)
            for start in range(0, out_channels, in_channels):  # 2 copies when upsampling (one per new frame)
                conv.weight[start:start + in_channels, :, -1, 0, 0] = eye
        elif isinstance(module, WanCausalConv3d) and module.weight.shape[2] > 1:
            module.weight[:, :, :-1] = 0.0


def reconstruction_loss(recon: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mask-weighted MSE + 0.1 L1. recon/target (B, 3, F, H, W) in [-1, 1]; mask (B, F, H, W) in [0, 1].

    MSE dominates: an L1-heavy loss pulls every pixel towards the median, the background, and hides small shapes.
    """
    weight = 1.0 + 3.0 * mask.unsqueeze(1)
    diff = recon - target
    return ((diff.square() + 0.1 * diff.abs()) * weight).mean() / weight.mean()


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """``vae.decode(z).sample`` without its final clamp to [-1, 1], whose zero gradient outside the range can
    freeze training when the untrained decoder saturates (it did here: held-out PSNR stuck at 17 dB, an all-dark
    frame's score). Mirrors ``AutoencoderKLWan._decode`` (diffusers 0.42): one latent frame at a time through the
    causal decoder with its feature cache. z: (B, z_dim, F', h, w) -> (B, 3, 4F'-3, 4h, 4w)."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    chunks = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        chunks.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(chunks, 2)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB between two tensors in [-1, 1] (peak-to-peak 2)."""
    mse = (a.clamp(-1, 1) - b.clamp(-1, 1)).square().mean().item()
    return 10 * math.log10(4.0 / max(mse, 1e-12))


@torch.no_grad()
def evaluate(vae, num_clips: int = 8, seed: int = 12345) -> float:
    """Mean PSNR (dB) of full-size clips of held-out prompt combinations through encode (mode) + decode."""
    vae.eval()
    videos, _, _ = sample_batch(num_clips, configs.NUM_FRAMES, configs.SIZE, torch.Generator().manual_seed(seed),
                                combos=held_out_combinations())
    scores = []
    for video in videos:
        recon = vae.decode(vae.encode(video[None]).latent_dist.mode()).sample
        scores.append(psnr(recon, video[None]))
    vae.train()
    return sum(scores) / len(scores)


def crop(videos: torch.Tensor, masks: torch.Tensor, size: int, generator: torch.Generator):
    top, left = (int(v) for v in torch.randint(videos.shape[-1] - size + 1, (2,), generator=generator))
    return videos[..., top:top + size, left:left + size], masks[..., top:top + size, left:left + size]


def phase(step: int, args: argparse.Namespace) -> tuple[int, int, int]:
    """(num_frames, batch size, crop size) of ``step``: single frames first (5x cheaper per step; they train the
    spatial path), then 9-frame clips on 32x32 crops (the causal temporal path), then full 64x64 clips."""
    if step < args.image_steps:
        return 1, 2 * args.batch_size, 32
    if step < args.steps - args.full_size_steps:
        return 9, args.batch_size, 32
    return 9, max(1, args.batch_size // 2), configs.SIZE


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="build/demo_model/vae", help="checkpoint and log folder")
    parser.add_argument("--steps", type=int, default=1500, help="total optimiser steps (the schedule's length)")
    parser.add_argument("--image-steps", type=int, default=700, help="first steps on single frames")
    parser.add_argument("--full-size-steps", type=int, default=100, help="final steps on full 64x64 clips")
    parser.add_argument("--batch-size", type=int, default=4, help="clips per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    parser.add_argument("--kl-weight", type=float, default=1e-4, help="weight of the mean per-element KL term")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    parser.add_argument("--eval-every", type=int, default=250, help="steps between held-out PSNR checks")
    parser.add_argument("--init-from", default=None,
                        help="start a new run (fresh optimiser and schedule) from a saved VAE folder; a stage-2 run")
    parser.add_argument("--stop-at", type=int, default=1250,
                        help="save `final` and stop at this step, before --steps (the shipped weights are step 1250)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    vae = build_vae()
    if args.init_from:
        from diffusers import AutoencoderKLWan

        vae.load_state_dict(AutoencoderKLWan.from_pretrained(args.init_from).state_dict())
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    run = ResumableRun(args.work_dir, vae, optimizer)
    vae.train()
    identity_marker = run.work_dir / "temporal_identity_init.done"
    last_step = min(args.steps, args.stop_at or args.steps)
    while run.step < last_step:
        run.set_learning_rate(args.lr, args.steps, warmup_steps=100)
        generator = run.generator(args.seed)
        num_frames, batch, crop_size = phase(run.step, args)
        if num_frames > 1 and not identity_marker.exists() and not args.init_from:
            make_temporal_paths_identity(vae)
            identity_marker.write_text(f"applied at step {run.step}\n")
            run.log(temporal_identity_init=1, heldout_psnr=round(evaluate(vae), 2))
        videos, masks, _ = sample_batch(batch, num_frames, configs.SIZE, generator)
        if crop_size < configs.SIZE:
            videos, masks = crop(videos, masks, crop_size, generator)
        posterior = vae.encode(videos).latent_dist
        recon = decode_unclamped(vae, posterior.sample(generator=generator))
        rec = reconstruction_loss(recon, videos, masks)
        kl = 0.5 * (posterior.mean.square() + posterior.var - 1.0 - posterior.logvar).mean()
        loss = rec + args.kl_weight * kl
        run.optimizer_step(loss)
        if run.step % 25 == 0:
            run.log(loss=round(loss.item(), 5), rec=round(rec.item(), 5), kl=round(kl.item(), 3),
                    train_psnr=round(psnr(recon.detach(), videos), 2))
        if run.step % args.eval_every == 0 or run.step == last_step:
            run.log(heldout_psnr=round(evaluate(vae), 2))
        run.maybe_save(force=run.step == last_step)
    vae.save_pretrained(run.work_dir / "final")
    print(f"saved {run.work_dir / 'final'}", flush=True)


if __name__ == "__main__":
    main()
