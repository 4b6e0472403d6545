"""Encode a fixed, seeded set of procedural clips to VAE latents once, for transformer training.

Shards of 64 clips are written atomically to ``work_dir/shards``; rerunning skips finished shards. Also measures
the per-channel latent mean and std that diffusers Wan pipelines read from the VAE config
(``latents_mean`` / ``latents_std``) to normalise latents for the transformer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from demo_models.video import configs
from demo_models.video.data import TEMPLATES, sample_batch, training_combinations

SHARD_SIZE = 64


@torch.no_grad()
def encode_shards(vae, work_dir: str | Path, num_clips: int, seed: int = 1, trail: int = 0,
                  centred: bool = False) -> list[Path]:
    """Write ``ceil(num_clips / 64)`` shards, each a dict: latents (N, z, F', h, w) float32 (raw, not normalised),
    combo (N,) index into :func:`training_combinations`, template (N,) index into ``TEMPLATES``; ``trail``: fading
    copies behind each shape (:class:`~demo_models.video.data.ClipSpec`) and ``centred`` starts
    (:func:`~demo_models.video.data.sample_spec`), both recorded in ``shards/data.json``.

    Raises:
        ValueError: the folder's shards were drawn with another ``trail`` or ``centred`` (they would be reused
            silently).
    """
    shard_dir = Path(work_dir) / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    record = shard_dir / "data.json"
    wanted = {"trail": trail, "centred": centred}
    old = json.loads(record.read_text()) if record.exists() else (
        {} if any(shard_dir.glob("shard_*.pt")) else wanted)  # shards from before the record: the shipped data
    drawn = {"trail": old.get("trail", 0), "centred": old.get("centred", False)}
    if drawn != wanted:
        raise ValueError(f"{shard_dir} holds clips drawn with {drawn}, not {wanted}: use another --work-dir")
    record.write_text(json.dumps(wanted) + "\n")
    combos = training_combinations()
    paths = []
    for index in range((num_clips + SHARD_SIZE - 1) // SHARD_SIZE):
        path = shard_dir / f"shard_{index:04d}.pt"
        paths.append(path)
        if path.exists():
            continue
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        videos, _, specs = sample_batch(SHARD_SIZE, configs.NUM_FRAMES, configs.SIZE, generator, combos=combos,
                                      trail=trail, centred=centred)
        latents = torch.cat([vae.encode(videos[i:i + 8]).latent_dist.mode() for i in range(0, SHARD_SIZE, 8)])
        shard = {
            "latents": latents,
            "combo": torch.tensor([combos.index((s.colour, s.shape, s.direction)) for s in specs]),
            "template": torch.randint(len(TEMPLATES), (SHARD_SIZE,), generator=generator),
        }
        torch.save(shard, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        print(f"encoded {path.name}", flush=True)
    return paths


def load_shards(paths: list[Path]) -> dict[str, torch.Tensor]:
    shards = [torch.load(p, map_location="cpu") for p in paths]
    return {key: torch.cat([s[key] for s in shards]) for key in shards[0]}


def latent_statistics(latents: torch.Tensor, work_dir: str | Path) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of raw latents (N, z, F', h, w); also written to ``latent_stats.json``."""
    mean = latents.mean(dim=(0, 2, 3, 4))
    std = latents.std(dim=(0, 2, 3, 4))
    stats = {"latents_mean": [round(v, 5) for v in mean.tolist()], "latents_std": [round(v, 5) for v in std.tolist()]}
    (Path(work_dir) / "latent_stats.json").write_text(json.dumps(stats, indent=1))
    return stats["latents_mean"], stats["latents_std"]
