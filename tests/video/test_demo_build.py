"""``demo_model.build.install``: what ships as the embedded model, on tiny pipelines in a temporary folder."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from demo_models.video.build import install


def _dtypes(folder):
    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}


def test_install_swaps_in_a_transformer_and_latent_stats_and_stores_half(tiny_wan_dir, tmp_path):
    candidate = tmp_path / "candidate"
    shutil.copytree(tiny_wan_dir / "transformer", candidate)
    z = json.loads((tiny_wan_dir / "vae" / "config.json").read_text())["z_dim"]
    stats = tmp_path / "latent_stats.json"
    stats.write_text(json.dumps({"latents_mean": [0.5] * z, "latents_std": [2.0] * z}))
    target = tmp_path / "shipped"
    target.mkdir()
    (target / "stale.txt").write_text("from the previous model")

    size = install(tiny_wan_dir, target, 12, 3.5, transformer=candidate, latent_stats=stats)

    assert not (target / "stale.txt").exists() and size > 0
    config = json.loads((target / "vae" / "config.json").read_text())
    assert config["latents_mean"] == [0.5] * z and config["latents_std"] == [2.0] * z
    assert _dtypes(target / "transformer") == {torch.float16} and _dtypes(target / "vae") == {torch.float16}
    settings = json.loads((target / "metainfer_gen.json").read_text())
    assert (settings["num_inference_steps"], settings["guidance_scale"]) == (12, 3.5)


def test_install_refuses_to_copy_the_model_onto_itself(tiny_wan_dir, tmp_path):
    target = tmp_path / "shipped"
    shutil.copytree(tiny_wan_dir, target)
    with pytest.raises(SystemExit, match="copy it elsewhere first"):
        install(target, target, 20, 4.0)
    assert (target / "model_index.json").exists()  # nothing was deleted
