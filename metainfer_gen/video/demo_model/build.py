"""Copy the trained pipeline into the package as the embedded default model, with its call defaults.

Run after ``train_transformer``::

    python -m metainfer_gen.video.demo_model.build --pipeline-dir build/demo_model/pipeline

Writes ``metainfer_gen/assets/demo_wan/`` (diffusers layout, safetensors) and ``metainfer_gen.json`` beside
``model_index.json``: the default ``num_frames``, size, steps, guidance and fps that the pipelines, CLI and demo
use when the caller gives none, and the ``max_sequence_length`` the transformer was trained at (from the
``metainfer_gen.json`` that ``train_transformer`` wrote).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from metainfer_gen.video.demo_model import configs

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline-dir", default="build/demo_model/pipeline", help="output of train_transformer")
    parser.add_argument("--num-inference-steps", type=int, default=DEFAULT_SETTINGS["num_inference_steps"],
                        help="default steps written to the settings file")
    parser.add_argument("--guidance-scale", type=float, default=DEFAULT_SETTINGS["guidance_scale"],
                        help="default guidance written to the settings file")
    args = parser.parse_args(argv)

    from metainfer_gen.pipelines.loading import DEFAULT_MODEL_DIR, SETTINGS_FILE

    target = Path(__file__).resolve().parents[2] / "assets" / DEFAULT_MODEL_DIR
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(args.pipeline_dir, target)
    for part in HALF_PRECISION_PARTS:
        store_half(target / part)
    trained = target / SETTINGS_FILE  # what train_transformer fixed (the prompt length the model reads)
    settings = {**DEFAULT_SETTINGS, **(json.loads(trained.read_text()) if trained.exists() else {}),
                "num_inference_steps": args.num_inference_steps, "guidance_scale": args.guidance_scale}
    (target / SETTINGS_FILE).write_text(json.dumps(settings, indent=1) + "\n")
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    if size > MAX_BYTES:
        raise SystemExit(f"embedded model is {size / 2**20:.1f} MiB; the budget is {MAX_BYTES / 2**20:.0f} MiB")
    print(f"wrote {target} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
