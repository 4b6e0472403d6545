"""What the two demo-LoRA training scripts share: a trainable peft LoRA on a pipeline's transformer, the
transformer call with Wan 2.2 per-token timesteps, the latent normalisation, and saving in diffusers' layout.

The LoRA is diffusers' ``add_adapter`` (peft ``LoraConfig``) on the attention and feed-forward linears of every
block plus ``proj_out``, alpha = rank (scale 1), initialised from the run's seed (lora_B = 0: training starts from
the base model). The saved file holds ``transformer.<module>.lora_A/lora_B.weight`` tensors, which
``pipe.load_lora`` (and stock diffusers ``load_lora_weights``) read.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch

ADAPTER = "demo_lora"  # not "train": peft adds the name as a module attribute
TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "proj_out"]


def load_pipeline(model: str | None):
    """Our ``TextToVideoPipeline`` on the CPU in float32 (``model``: a pipeline folder; None: the embedded one)."""
    from metainfer_gen.pipelines import TextToVideoPipeline

    pipe = TextToVideoPipeline.from_pretrained(model, device="cpu", torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def add_trainable_lora(transformer: torch.nn.Module, rank: int, seed: int) -> list[torch.nn.Parameter]:
    """Freeze ``transformer`` and add a LoRA of ``rank`` named :data:`ADAPTER`; return its parameters."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    torch.manual_seed(seed)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGET_MODULES,
                                       init_lora_weights=True), adapter_name=ADAPTER)
    return [p for n, p in transformer.named_parameters() if p.requires_grad and ADAPTER in n]


def save_lora(transformer: torch.nn.Module, path: str | Path) -> Path:
    """Write the trained adapter as diffusers-layout safetensors (float32), atomically."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(transformer, adapter_name=ADAPTER)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({f"transformer.{k}": v.detach().float().contiguous() for k, v in state.items()}, str(tmp))
    tmp.replace(path)
    return path


def normalised_latents(vae, videos: torch.Tensor) -> torch.Tensor:
    """VAE latents (B, z, F', h, w) of videos (B, 3, F, H, W) in [-1, 1], normalised as Wan pipelines expect
    (``(x - latents_mean) / latents_std``, per channel from the VAE config)."""
    latents = torch.cat([vae.encode(videos[i:i + 8]).latent_dist.mode() for i in range(0, len(videos), 8)])
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (latents - mean) / std


def predict_velocity(transformer, latents: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """The transformer's flow prediction (noise - x0) for ``latents`` (B, z, F', h, w) at noise levels ``sigma``
    (B,) in [0, 1], with per-token timesteps ``1000 * sigma`` as diffusers' Wan pipeline passes them when
    ``expand_timesteps`` is set (every token at the clip's level: text-to-video)."""
    _, patch_h, patch_w = transformer.config.patch_size
    _, _, frames, height, width = latents.shape
    tokens = frames * (height // patch_h) * (width // patch_w)
    timestep = (sigma.view(-1, 1) * 1000).expand(-1, tokens)
    return transformer(latents, timestep, embeds, return_dict=False)[0]


def add_arguments(parser: argparse.ArgumentParser, name: str, steps: int, rank: int, lr: float) -> None:
    """The arguments both scripts take: the pipeline folder, work folder, output, optimisation and clip size."""
    parser.add_argument("model", help="pipeline folder to train on (the final embedded model: a build output)")
    parser.add_argument("--work-dir", default=f"build/demo_model/{name}", help="checkpoint, data and log folder")
    parser.add_argument("--out", default=f"build/demo_model/{name}/{name}.safetensors",
                        help="where the trained LoRA goes (.safetensors)")
    parser.add_argument("--steps", type=int, default=steps, help="total optimiser steps")
    parser.add_argument("--batch-size", type=int, default=8, help="training examples per step")
    parser.add_argument("--rank", type=int, default=rank, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=lr, help="peak AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, LoRA init and batches")
    parser.add_argument("--num-frames", type=int, default=None, help="clip frames (default: the model's)")
    parser.add_argument("--size", type=int, default=None, help="clip height and width (default: the model's)")
    parser.add_argument("--eval-prompts", type=int, default=24,
                        help="held-out prompts rendered by the evaluation (0: no evaluation)")


def train(pipe, args: argparse.Namespace, batch_loss: Callable[[torch.nn.Module, torch.Generator], tuple]) -> Path:
    """Train a LoRA on ``pipe``'s transformer and save it to ``args.out``; resumable in ``args.work_dir``.

    ``batch_loss(transformer, generator)`` draws one batch from the step's generator (seeded by seed and step, so
    a resumed run sees the batches an uninterrupted one would) and returns ``(loss, {extra log values})``.
    AdamW on the LoRA parameters only, warm-up then cosine decay (``training.learning_rate``). The adapter is
    removed from the transformer afterwards, so ``pipe`` is the base model again.
    """
    from demo_models.training import ResumableRun

    transformer = pipe.diffusers_pipeline.transformer
    params = add_trainable_lora(transformer, args.rank, args.seed)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    run = ResumableRun(args.work_dir, transformer, optimizer)
    transformer.train()
    while run.step < args.steps:
        run.set_learning_rate(args.lr, args.steps, warmup_steps=min(50, max(args.steps // 10, 1)))
        loss, extra = batch_loss(transformer, run.generator(args.seed))
        run.optimizer_step(loss)
        if run.step % 25 == 0 or run.step == args.steps:
            run.log(loss=round(loss.item(), 5), lr=round(optimizer.param_groups[0]["lr"], 7), **extra)
        run.maybe_save(force=run.step == args.steps)
    transformer.eval()
    out = save_lora(transformer, args.out)
    transformer.delete_adapters(ADAPTER)
    return out
