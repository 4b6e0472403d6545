"""The demo-LoRA training scripts on the tiny random Wan pipeline: they train, resume, save a LoRA our loader
reads completely, and measure their effect (the real effect needs the real model: see the scripts' eval.json).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from demo_models.video import lora_eval, train_step_lora, train_style_lora

TINY = ["--num-frames", "5", "--size", "32", "--batch-size", "4", "--seed", "0"]


def test_teacher_latents_interpolate_exactly_along_an_euler_trajectory():
    sigmas = torch.tensor([1.0, 0.7, 0.3, 0.0])
    velocity = torch.randn(2, 3, 4)  # per segment: a piecewise-linear path in sigma
    start = torch.randn(2, 4)
    path = [start]
    for j in range(3):
        path.append(path[-1] + (sigmas[j + 1] - sigmas[j]) * velocity[:, j])
    trajectory = torch.stack(path, dim=1)  # (B, 4, 4)
    queries = torch.tensor([1.0, 0.85, 0.3, 0.1, 0.0])
    expected = torch.stack([start, start - 0.15 * velocity[:, 0], path[2], path[2] - 0.2 * velocity[:, 2], path[3]],
                           dim=1)
    torch.testing.assert_close(train_step_lora.at_sigmas(trajectory, sigmas, queries), expected)


def test_teacher_runs_the_model_at_its_own_prompt_length(tiny_wan_dir, tmp_path):
    """The embedded model reads 16 prompt rows (its settings file); a teacher at diffusers' default 512 is another,
    worse model, and a LoRA distilled from it lost adherence and fidelity against the real one."""
    import argparse
    import shutil

    from metainfer_gen.pipelines.loading import SETTINGS_FILE
    from demo_models.video import lora_training

    model = tmp_path / "model"
    shutil.copytree(tiny_wan_dir, model)
    (model / SETTINGS_FILE).write_text(json.dumps({"max_sequence_length": 16}))
    pipe = lora_training.load_pipeline(str(model))
    args = argparse.Namespace(seed=0, teacher_steps=3, num_frames=5, size=32, guidance=1.0)
    data = train_step_lora.teacher_shards(pipe, tmp_path / "work", args, 2, [3])

    diffusers_pipe = pipe.diffusers_pipeline  # the teacher's own draws (train_step_lora.teacher_shards), redone
    generator = torch.Generator().manual_seed(0)
    prompts = train_step_lora.prompt_table(diffusers_pipe)[1]
    chosen = torch.randint(len(prompts) - 1, (train_step_lora.SHARD,), generator=generator)
    noise = torch.randn(data["K3"][:, 0].shape, generator=generator)
    torch.testing.assert_close(data["K3"][:, 0], noise)

    def final(length):
        return diffusers_pipe([prompts[i] for i in chosen], num_frames=5, height=32, width=32, num_inference_steps=3,
                              guidance_scale=1.0, max_sequence_length=length, latents=noise.clone(),
                              output_type="latent").frames

    torch.testing.assert_close(data["K3"][:, -1], final(16))
    assert not torch.allclose(data["K3"][:, -1], final(512), atol=1e-4)  # the length matters on this model


def test_step_lora_distils_resumes_and_loads_completely(tiny_wan_dir, tmp_path, capsys):
    from metainfer_gen.pipelines import TextToVideoPipeline

    work, out = tmp_path / "work", tmp_path / "steps.safetensors"
    args = [str(tiny_wan_dir), "--work-dir", str(work), "--out", str(out), "--teacher-steps", "6",
            "--student-steps", "2,3", "--num-prompts", "16", "--lr", "5e-3", *TINY]
    train_step_lora.main([*args, "--steps", "4", "--eval-prompts", "0"])
    shard = work / "teacher" / "shard_0000.pt"
    stamp = shard.stat().st_mtime_ns
    data = torch.load(shard)
    assert data["K2"].shape[:2] == (16, 3) and data["K3"].shape[:2] == (16, 4)
    result = train_step_lora.main([*args, "--steps", "8", "--eval-prompts", "1"])
    log = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    assert "resumed" in capsys.readouterr().out and shard.stat().st_mtime_ns == stamp  # teacher kept
    assert [r["step"] for r in log] == [4, 8]
    assert [row["name"] for row in result["rows"]] == ["base 6 steps", "step LoRA 2 steps", "step LoRA 3 steps",
                                                      "base unguided 2 steps", "base unguided 3 steps"]
    assert all(row["psnr"] > 0 and 0 < row["ssim"] <= 1 for row in result["rows"][1:])
    pipe = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu")
    report = pipe.load_lora(out)
    assert report.skipped == {} and len(report.modules) == 2 * 10 + 1  # 10 linears per block, and proj_out
    assert any(v.abs().sum() > 0 for k, v in load_file(out).items() if "lora_B" in k)  # it learned something


def test_style_lora_moves_the_background_at_weight_1_and_not_at_0(tiny_wan_dir, tmp_path):
    from metainfer_gen.pipelines import TextToVideoPipeline

    work = tmp_path / "work"
    result = train_style_lora.main([str(tiny_wan_dir), "--work-dir", str(work), "--out", str(work / "s.safetensors"),
                                    "--num-clips", "16", "--steps", "60", "--lr", "1e-2", "--eval-prompts", "2",
                                    "--eval-steps", "4", *TINY])
    pipe = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    base = lora_eval.background_colour(lora_eval.render(pipe, lora_eval.held_out_prompts(2), num_frames=5,
                                                        height=32, width=32, num_inference_steps=4))
    np.testing.assert_allclose(result["weight_0"]["background"], base, atol=1e-4)  # weight 0: the base model
    # Weight 1 moves the background towards the style (as this tiny random VAE renders it) by at least a quarter.
    assert result["weight_1"]["distance_to_target"] < 0.75 * result["weight_0"]["distance_to_target"]


def test_style_lora_refuses_latents_encoded_with_the_other_start_rule(tiny_wan_dir, tmp_path):
    work = tmp_path / "work"
    args = [str(tiny_wan_dir), "--work-dir", str(work), "--out", str(work / "s.safetensors"), "--num-clips", "4",
            "--steps", "1", "--eval-prompts", "0", *TINY]
    train_style_lora.main(args)
    assert torch.load(work / "latents.pt")["centred"] is True
    with pytest.raises(ValueError, match="centred=True, not False"):
        train_style_lora.main([*args, "--no-centred-start"])
