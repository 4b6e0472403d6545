"""The video pipelines speak diffusers: its documented Wan snippets run unchanged (``output_type="np"``,
``export_to_video(output.frames[0], ...)``), ``num_videos_per_prompt``, the other output types, ``.to()``,
``.components``, component attributes, CPU offload and ``callback_on_step_end``."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline
from metainfer_gen.video.output import FramesOutput, VideoOutput

PROMPT = "a red circle moving right"
NEGATIVE = "blurry, static"
CALL = dict(height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=5.0)


@pytest.fixture(scope="module")
def pipe(tiny_wan_dir):
    pipe = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _decoded(path) -> np.ndarray:
    return iio.imread(path).astype(np.float64)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_wan_text_to_video_snippet_runs_unchanged_and_matches_save(tmp_path):
    # diffusers' Wan T2V snippet on the embedded model (its sizes, few steps, a generator for a fixed clip).
    from diffusers import AutoencoderKLWan
    from diffusers.utils import export_to_video

    from metainfer_gen.pipelines.loading import default_model_path

    model_id = str(default_model_path())
    vae = AutoencoderKLWan.from_pretrained(model_id, subfolder="vae", torch_dtype=torch.float32)
    pipe = TextToVideoPipeline.from_pretrained(model_id, vae=vae, torch_dtype=torch.float32)
    pipe.to("cpu")
    pipe.set_progress_bar_config(disable=True)
    call = dict(height=64, width=64, num_frames=9, guidance_scale=4.0, num_inference_steps=4)
    output = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, **call, output_type="np",
                  generator=torch.Generator().manual_seed(7)).frames[0]
    export_to_video(output, str(tmp_path / "output.mp4"), fps=15)

    assert output.shape == (9, 64, 64, 3) and output.dtype == np.float32
    assert 0.0 <= output.min() and output.max() <= 1.0
    ours = pipe(PROMPT, negative_prompt=NEGATIVE, **call, seed=7)
    ours.save(tmp_path / "ours.mp4", fps=15)
    # the same frames (ours rounds to uint8, diffusers' export truncates) ...
    assert np.abs(ours.frames.astype(np.float64) / 255.0 - output).max() <= 1.0 / 255.0 + 1e-6
    # ... and both files hold that clip, frame for frame (both encoders are lossy H.264)
    theirs, saved = _decoded(tmp_path / "output.mp4"), _decoded(tmp_path / "ours.mp4")
    assert theirs.shape == saved.shape == (9, 64, 64, 3)
    for decoded in (theirs, saved):
        assert _psnr(decoded, ours.frames.astype(np.float64)) > 30.0


def test_wan_image_to_video_snippet_runs_unchanged(tiny_wan_i2v_dir, tmp_path):
    # diffusers' Wan I2V snippet: size from the pipeline's own attributes, then export_to_video.
    from diffusers.utils import export_to_video
    from PIL import Image

    pipe = ImageToVideoPipeline.from_pretrained(str(tiny_wan_i2v_dir), torch_dtype=torch.float32)
    pipe.to("cpu")
    pipe.set_progress_bar_config(disable=True)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    max_area = 32 * 32
    aspect_ratio = image.height / image.width
    mod_value = pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]
    height = round(np.sqrt(max_area * aspect_ratio)) // mod_value * mod_value
    width = round(np.sqrt(max_area / aspect_ratio)) // mod_value * mod_value
    image = image.resize((width, height))
    output = pipe(image=image, prompt=PROMPT, negative_prompt=NEGATIVE, height=height, width=width, num_frames=9,
                  guidance_scale=5.0, num_inference_steps=2, output_type="np",
                  generator=torch.Generator().manual_seed(3)).frames[0]
    export_to_video(output, str(tmp_path / "i2v.mp4"), fps=16)

    ours = pipe(image, PROMPT, negative_prompt=NEGATIVE, height=height, width=width, num_frames=9,
                guidance_scale=5.0, num_inference_steps=2, seed=3)
    assert np.abs(ours.frames.astype(np.float64) / 255.0 - output).max() <= 1.0 / 255.0 + 1e-6
    assert _decoded(tmp_path / "i2v.mp4").shape == (9, 32, 32, 3)


def test_num_videos_per_prompt_equals_single_calls_with_the_drawn_seeds(pipe):
    many = pipe(PROMPT, **CALL, seed=11, num_videos_per_prompt=3)

    assert isinstance(many, list) and len(many) == 3
    assert [clip.settings["seed"] for clip in many] == [11, 12, 13]
    assert len({id(clip.stats) for clip in many}) == 3  # stats per video
    for clip in many:
        single = pipe(PROMPT, **CALL, seed=clip.settings["seed"])
        np.testing.assert_array_equal(clip.frames, single.frames)
        assert clip.stats.transformer_calls == single.stats.transformer_calls == 2 * CALL["num_inference_steps"]
    assert not np.array_equal(many[0].frames, many[1].frames)


def test_num_videos_per_prompt_with_a_generator_records_its_draws(pipe):
    many = pipe(PROMPT, **CALL, generator=torch.Generator().manual_seed(0), num_videos_per_prompt=2,
                output_type="np")
    assert isinstance(many, FramesOutput) and many.frames.shape == (2, 9, 32, 32, 3)
    seeds = [s["seed"] for s in many.settings]
    again = pipe(PROMPT, **CALL, seed=seeds[1], output_type="np")
    np.testing.assert_array_equal(many.frames[1], again.frames[0])


def test_prompt_lists_come_out_prompt_major(pipe):
    prompts = [PROMPT, "a blue square moving up"]
    out = pipe(prompts, **CALL, seed=4, num_videos_per_prompt=2)
    assert [clip.settings["seed"] for clip in out] == [4, 5, 4, 5]
    # video i of every prompt is one batched call with seed + i, as a list call with that seed
    batch = pipe(prompts, **CALL, seed=5)
    np.testing.assert_array_equal(out[1].frames, batch[0].frames)
    np.testing.assert_array_equal(out[3].frames, batch[1].frames)


@pytest.mark.parametrize("output_type", ["pt", "pil", "latent"])
def test_output_types_have_diffusers_layouts(pipe, output_type):
    reference = pipe(PROMPT, **CALL, seed=2, output_type="np").frames
    out = pipe(PROMPT, **CALL, seed=2, output_type=output_type)
    if output_type == "pt":
        assert out.frames.shape == (1, 9, 3, 32, 32)
        np.testing.assert_allclose(out.frames[0].permute(0, 2, 3, 1).numpy(), reference[0], atol=1e-6)
    elif output_type == "pil":
        assert len(out.frames) == 1 and len(out.frames[0]) == 9 and out.frames[0][0].size == (32, 32)
        assert np.abs(np.asarray(out.frames[0][4], dtype=np.float64) / 255 - reference[0][4]).max() <= 1 / 255 + 1e-6
    else:  # (videos, channels, latent frames, latent height, latent width): 4x time and space compression
        assert tuple(out.frames.shape) == (1, 4, 3, 8, 8)


def test_bad_options_are_refused_before_any_work(pipe, monkeypatch):
    monkeypatch.setattr(type(pipe.diffusers_pipeline), "__call__", lambda *a, **k: pytest.fail("ran the model"))
    with pytest.raises(ValueError, match="output_type must be one of 'np', 'pil', 'pt', 'latent'"):
        pipe(PROMPT, **CALL, output_type="mp4")
    with pytest.raises(ValueError, match="num_videos_per_prompt must be >= 1"):
        pipe(PROMPT, **CALL, num_videos_per_prompt=0)
    with pytest.raises(TypeError, match="num_videos_per_prompt must be an int"):
        pipe(PROMPT, **CALL, num_videos_per_prompt=2.0)


def test_components_attributes_and_to(pipe):
    wrapped = pipe.diffusers_pipeline
    assert set(pipe.components) >= {"vae", "transformer", "scheduler", "text_encoder", "tokenizer"}
    assert pipe.vae is wrapped.vae and pipe.scheduler is wrapped.scheduler and pipe.transformer is wrapped.transformer
    assert pipe.vae_scale_factor_spatial == wrapped.vae_scale_factor_spatial
    with pytest.raises(AttributeError, match="neither TextToVideoPipeline nor its WanPipeline"):
        pipe.no_such_thing
    assert pipe.to("cpu") is pipe
    pipe.to(torch.float64)
    try:
        assert next(pipe.transformer.parameters()).dtype == torch.float64
    finally:
        pipe.to(torch.float32)
    assert next(pipe.transformer.parameters()).dtype == torch.float32


def test_embed_memo_is_on_by_default_in_python(tiny_wan_dir):
    assert TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu").embed_memo_enabled
    assert not TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu", embed_memo=False).embed_memo_enabled


def test_a_model_the_memo_does_not_fit_loads_without_it(tiny_wan_dir, monkeypatch):
    monkeypatch.setattr("metainfer_gen.video.cache.embed_memo.embed_memo_refusal", lambda model: "no embedder")
    assert not TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu").embed_memo_enabled


def test_model_cpu_offload_gives_the_same_clip_with_step_cache_and_lora(tiny_wan_dir):
    from tests.video.lora_files import make_lora, state_dict

    def render(offload: bool) -> VideoOutput:
        pipe = TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu")
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora(state_dict(make_lora(pipe.transformer), "diffusers"), adapter_name="style", weight=0.7)
        pipe.enable_step_cache("fast")
        if offload:
            pipe.enable_model_cpu_offload(device="cpu")  # no accelerator here: the hooks run, the weights stay
        return pipe(PROMPT, **{**CALL, "num_inference_steps": 12}, seed=9)

    plain, offloaded = render(False), render(True)
    np.testing.assert_array_equal(plain.frames, offloaded.frames)
    assert plain.stats.cache["num_reused"] == offloaded.stats.cache["num_reused"] > 0


def test_sequential_offload_to_the_cpu_is_refused_with_the_reason(pipe):
    with pytest.raises(ValueError, match="sequential CPU offload moves weights from the CPU to an accelerator"):
        pipe.enable_sequential_cpu_offload(device="cpu")


def test_callback_on_step_end_is_passed_through(pipe):
    seen = []

    def callback(diffusers_pipe, step, timestep, callback_kwargs):
        seen.append((step, tuple(callback_kwargs["latents"].shape)))
        return callback_kwargs

    with_callback = pipe(PROMPT, **CALL, seed=1, callback_on_step_end=callback)
    assert seen == [(0, (1, 4, 3, 8, 8)), (1, (1, 4, 3, 8, 8))]
    np.testing.assert_array_equal(with_callback.frames, pipe(PROMPT, **CALL, seed=1).frames)
