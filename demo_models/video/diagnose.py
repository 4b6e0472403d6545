"""Why a demo transformer does (not) follow a prompt word: measured on training latents, no sampling involved.

Two readings per noise level ``sigma`` (rectified flow, ``x_s = (1 - s) x_0 + s * noise``):

* **word sensitivity**: the flow-matching loss with the true prompt, and with one word swapped (the direction,
  the colour, the shape) or the prompt dropped. A word the model uses raises the loss when it is wrong; a gap
  near zero means the transformer ignores that word at that noise level.
* **motion extrapolation** (image-to-video: clean first latent frame, the others at ``sigma``): the object's
  centroid in the predicted clean latent ``x_0 = x_s - s * v`` against the true one, per latent frame, next to the
  error of a guess that the object stays where the first frame shows it. Below that "static" error the model
  moves the object the right way; above it, the wrong way. Also the mean displacement of the predicted object
  from its first-frame position along the true direction, with the true prompt and with the direction word
  swapped: equal columns mean the path comes from the noisy frames, not from the word.

Run (a pipeline folder written by ``train_transformer``; reads its ``work_dir`` shards)::

    python -m demo_models.video.diagnose build/demo_model/pipeline \
        --work-dir build/demo_model/transformer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from demo_models.video.data import COLOURS, DIRECTIONS, SHAPES, TEMPLATES, training_combinations

SWAPS = {"direction": list(DIRECTIONS), "colour": list(COLOURS), "shape": list(SHAPES)}


def latent_centroids(latents: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """Centroid (x, y), in latent pixels, of the object in every latent frame.

    The object is where the channel-norm distance to the top-left 2x2 corner (the background) exceeds
    ``threshold`` times its maximum in that frame.

    Args:
        latents: (B, C, F, H, W) float, raw or normalised; compare centroids only between latents in the same space
            (a per-channel scale reweights the channel norm, so raw and normalised centroids differ slightly).
    Returns:
        (B, F, 2) float32; NaN where a frame has no object pixel.
    """
    _, _, frames, height, width = latents.shape
    ys, xs = torch.meshgrid(torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32),
                            indexing="ij")
    out = []
    for k in range(frames):
        frame = latents[:, :, k].float()
        energy = (frame - frame[:, :, :2, :2].mean(dim=(2, 3), keepdim=True)).norm(dim=1)
        energy = energy / energy.flatten(1).amax(1).clamp_min(1e-12).view(-1, 1, 1)
        weight = (energy > threshold).float()
        total = weight.sum((1, 2))
        out.append(torch.stack([(weight * xs).sum((1, 2)) / total, (weight * ys).sum((1, 2)) / total], -1))
    return torch.stack(out, 1)


def swapped_prompts(combos: list[tuple[str, str, str]], word: str | None) -> list[str]:
    """Template-0 prompts of ``combos`` with ``word`` ("direction", "colour", "shape") replaced by the next value of
    its list; ``None`` keeps the prompt, ``"empty"`` gives ``""``."""
    prompts = []
    for colour, shape, direction in combos:
        values = {"colour": colour, "shape": shape, "direction": direction}
        if word == "empty":
            prompts.append("")
            continue
        if word is not None:
            options = SWAPS[word]
            values[word] = options[(options.index(values[word]) + 1) % len(options)]
        prompts.append(TEMPLATES[0].format(**values))
    return prompts


@torch.no_grad()
def diagnose(pipeline_dir: str, work_dir: str, num_clips: int = 64, sigmas=(0.3, 0.6, 0.8, 0.9, 0.97, 0.99),
             seed: int = 0, text_length: int | None = None) -> dict:
    """Both readings on the first ``num_clips`` training clips; returns ``{"t2v": ..., "i2v": ..., "motion": ...}``
    where t2v/i2v map ``sigma`` to ``{prompt variant: loss}`` and motion maps ``sigma`` to per-frame centroid
    errors (latent pixels) with the static guess's errors, and per-frame displacements along the true direction
    (``"along"``: truth, true prompt, direction word swapped)."""
    from diffusers import WanPipeline

    from demo_models.video.latents import SHARD_SIZE, load_shards

    from metainfer_gen.pipelines.loading import model_settings

    pipe = WanPipeline.from_pretrained(pipeline_dir)
    text_length = text_length or model_settings(pipeline_dir).get("max_sequence_length", 512)
    transformer = pipe.transformer.eval()
    shards = sorted((Path(work_dir) / "shards").glob("shard_*.pt"))
    data = load_shards(shards[:-(-num_clips // SHARD_SIZE)])
    stats = json.loads((Path(work_dir) / "latent_stats.json").read_text())
    mean = torch.tensor(stats["latents_mean"]).view(1, -1, 1, 1, 1)
    std = torch.tensor(stats["latents_std"]).view(1, -1, 1, 1, 1)
    x0 = ((data["latents"][:num_clips] - mean) / std).float()
    combos = [training_combinations()[i] for i in data["combo"][:num_clips].tolist()]
    variants = (None, "direction", "colour", "shape", "empty")
    embeds = {}
    for word in variants:
        embeds[word or "true"], _ = pipe.encode_prompt(swapped_prompts(combos, word), do_classifier_free_guidance=False,
                                                       max_sequence_length=text_length, device=torch.device("cpu"))
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    frames, height, width = x0.shape[2:]
    _, patch_h, patch_w = pipe.transformer.config.patch_size
    per_frame = (height // patch_h) * (width // patch_w)
    true_centroids = latent_centroids(x0)
    static = (true_centroids[:, :1] - true_centroids).norm(dim=-1).nanmean(0)
    unit = torch.tensor([DIRECTIONS[c[2]] for c in combos]).view(-1, 1, 2)  # (N, 1, 2) (dx, dy) per clip

    def along(centroids: torch.Tensor) -> list[float]:
        moved = ((centroids - true_centroids[:, :1]) * unit).sum(-1).nanmean(0)
        return [round(v, 2) for v in moved.tolist()]

    result: dict = {"t2v": {}, "i2v": {}, "motion": {}, "along": {"truth": along(true_centroids)}}
    for sigma in sigmas:
        for task in ("t2v", "i2v"):
            xt = (1 - sigma) * x0 + sigma * noise
            timestep = torch.full((len(x0), frames * per_frame), sigma * 1000.0)
            if task == "i2v":
                xt[:, :, 0] = x0[:, :, 0]
                timestep[:, :per_frame] = 0.0
            first = 1 if task == "i2v" else 0
            losses = {}
            for name, embed in embeds.items():
                pred = torch.cat([transformer(xt[i:i + 16], timestep[i:i + 16], embed[i:i + 16], return_dict=False)[0]
                                  for i in range(0, len(x0), 16)])
                losses[name] = round(((pred - (noise - x0))[:, :, first:] ** 2).mean().item(), 5)
                if task == "i2v" and name in ("true", "direction"):
                    predicted = latent_centroids(xt - sigma * pred)
                    result["along"].setdefault(sigma, {})[name] = along(predicted)
                if task == "i2v" and name == "true":
                    errors = (predicted - true_centroids).norm(dim=-1).nanmean(0)
                    result["motion"][sigma] = {"model": [round(v, 2) for v in errors.tolist()],
                                               "static": [round(v, 2) for v in static.tolist()]}
            result[task][sigma] = losses
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline_dir", help="pipeline folder (train_transformer's --out-dir)")
    parser.add_argument("--work-dir", default="build/demo_model/transformer", help="train_transformer's work dir")
    parser.add_argument("--num-clips", type=int, default=64, help="training clips to measure on")
    parser.add_argument("--text-length", type=int, default=None,
                        help="max_sequence_length the model was trained at (default: its metainfer_gen.json, else 512)")
    args = parser.parse_args(argv)
    result = diagnose(args.pipeline_dir, args.work_dir, args.num_clips, text_length=args.text_length)
    for task in ("t2v", "i2v"):
        print(f"{task}: loss per prompt variant (a word the model reads raises the loss when swapped)")
        for sigma, losses in result[task].items():
            true = losses["true"]
            gaps = "  ".join(f"{k} {v - true:+.4f}" for k, v in losses.items() if k != "true")
            print(f"  sigma {sigma:<5} true {true:.4f}  {gaps}")
    print("i2v motion: centroid error per latent frame (latent px), model vs a static guess")
    for sigma, row in result["motion"].items():
        print(f"  sigma {sigma:<5} model {row['model']}  static {row['static']}")
    print(f"i2v displacement along the true direction per latent frame (latent px); truth {result['along']['truth']}")
    for sigma, row in result["along"].items():
        if sigma != "truth":
            print(f"  sigma {sigma:<5} true prompt {row['true']}  direction swapped {row['direction']}")


if __name__ == "__main__":
    main()
