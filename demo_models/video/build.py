"""Copy the trained pipeline into the package as the embedded default model, with its call defaults.

Run after ``train_transformer``::

    python -m demo_models.video.build --pipeline-dir build/demo_model/pipeline

Writes ``metainfer_gen/assets/demo_wan/`` (diffusers layout, safetensors) and ``metainfer_gen.json`` beside
``model_index.json``: the default ``num_frames``, size, steps, guidance and fps that the pipelines, CLI and demo
use when the caller gives none, and the ``max_sequence_length`` the transformer was trained at (from the
``metainfer_gen.json`` that ``train_transformer`` wrote).

``--transformer DIR --latent-stats FILE`` put a committed transformer (e.g. ``artifacts/demo_wan_direction``) and
the latent statistics of its training data in place of the pipeline folder's own, so a trained candidate ships
without training again; ``--pipeline-dir`` must then be a copy of the current model, not the model itself.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from demo_models import ASSETS
from demo_models.video import configs

DEFAULT_SETTINGS = {
    "num_frames": configs.NUM_FRAMES,
    "height": configs.SIZE,
    "width": configs.SIZE,
    "num_inference_steps": 20,
    "guidance_scale": 4.0,
    "fps": 8.0,
}
MAX_BYTES = 30 * 2**20
# Stored in float16 to fit the package budget (weights of this size lose nothing visible; loading upcasts them to
# the requested dtype). The text encoder stays float32: transformers would keep a stored float16 and run it so.
HALF_PRECISION_PARTS = ("vae", "transformer")


def store_half(folder: Path) -> None:
    """Rewrite the float32 tensors of ``folder/*.safetensors`` as float16, keeping the file's metadata."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tensors = {k: v.half() if v.dtype == torch.float32 else v for k, v in tensors.items()}
        save_file(tensors, str(path), metadata=metadata)


def install(pipeline_dir: str | Path, target: Path, num_inference_steps: int, guidance_scale: float,
            transformer: str | Path | None = None, latent_stats: str | Path | None = None) -> int:
    """Copy ``pipeline_dir`` to ``target`` (replacing it), optionally with another ``transformer`` folder and the
    VAE config's ``latents_mean``/``latents_std`` from ``latent_stats``; store the VAE and transformer in float16;
    write the call defaults. Returns the folder's size in bytes.

    Raises:
        SystemExit: ``pipeline_dir`` is ``target`` itself (it would be deleted before being read), or the folder
            exceeds the package budget (:data:`MAX_BYTES`).
    """
    from metainfer_gen.pipelines.loading import SETTINGS_FILE

    if Path(pipeline_dir).resolve() == target.resolve():
        raise SystemExit(f"--pipeline-dir is the embedded model itself ({target}), which this replaces: copy it "
                         "elsewhere first (cp -r) and pass the copy")
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(pipeline_dir, target)
    if transformer:
        shutil.rmtree(target / "transformer")
        shutil.copytree(transformer, target / "transformer")
    if latent_stats:
        vae_config = target / "vae" / "config.json"
        stats = json.loads(Path(latent_stats).read_text())
        config = json.loads(vae_config.read_text())
        config.update(latents_mean=stats["latents_mean"], latents_std=stats["latents_std"])
        vae_config.write_text(json.dumps(config, indent=2) + "\n")
    for part in HALF_PRECISION_PARTS:
        store_half(target / part)
    trained = target / SETTINGS_FILE  # what train_transformer fixed (the prompt length the model reads)
    settings = {**DEFAULT_SETTINGS, **(json.loads(trained.read_text()) if trained.exists() else {}),
                "num_inference_steps": num_inference_steps, "guidance_scale": guidance_scale}
    (target / SETTINGS_FILE).write_text(json.dumps(settings, indent=1) + "\n")
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    if size > MAX_BYTES:
        raise SystemExit(f"embedded model is {size / 2**20:.1f} MiB; the budget is {MAX_BYTES / 2**20:.0f} MiB")
    return size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline-dir", default="build/demo_model/pipeline", help="output of train_transformer")
    parser.add_argument("--num-inference-steps", type=int, default=DEFAULT_SETTINGS["num_inference_steps"],
                        help="default steps written to the settings file")
    parser.add_argument("--guidance-scale", type=float, default=DEFAULT_SETTINGS["guidance_scale"],
                        help="default guidance written to the settings file")
    parser.add_argument("--transformer", default=None,
                        help="transformer folder (save_pretrained) to use instead of the pipeline folder's")
    parser.add_argument("--latent-stats", default=None,
                        help="latent_stats.json of the transformer's training data, written into the VAE config")
    args = parser.parse_args(argv)

    from metainfer_gen.pipelines.loading import DEFAULT_MODEL_DIR

    target = ASSETS / DEFAULT_MODEL_DIR
    size = install(args.pipeline_dir, target, args.num_inference_steps, args.guidance_scale, args.transformer,
                   args.latent_stats)
    print(f"wrote {target} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
