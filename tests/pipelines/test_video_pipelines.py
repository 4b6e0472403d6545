"""``TextToVideoPipeline`` / ``ImageToVideoPipeline`` on tiny random Wan checkpoints (see ``tests/conftest.py``)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from metainfer_gen.pipelines import ImageToVideoPipeline, TextToVideoPipeline
from metainfer_gen.video.output import VideoOutput
from tests.video.mp4_inspect import ffmpeg_stream_info, mp4_top_level_atoms

PROMPT = "a red circle moving right"
SMALL = dict(height=32, width=32, num_inference_steps=2)


def random_image(height: int = 32, width: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def t2v(tiny_wan_dir):
    return quiet(TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu"))


@pytest.fixture(scope="module")
def ti2v(tiny_wan_dir):
    """Image-to-video converted from the Wan 2.2 TI2V-style ``WanPipeline`` checkpoint."""
    return quiet(ImageToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu"))


@pytest.fixture(scope="module")
def i2v21(tiny_wan_i2v_dir):
    """Image-to-video loaded natively from the Wan 2.1-style checkpoint."""
    return quiet(ImageToVideoPipeline.from_pretrained(tiny_wan_i2v_dir, device="cpu"))


class WorkCounter:
    """Counts every model computation a pipeline could start: transformer / text encoder forwards, VAE codes."""

    def __init__(self, pipe, monkeypatch):
        self.calls: dict[str, int] = {}
        diffusers_pipe = pipe.diffusers_pipeline
        self.handles = [self._hook(name, getattr(diffusers_pipe, name))
                        for name in ("transformer", "transformer_2", "text_encoder")
                        if getattr(diffusers_pipe, name, None) is not None]
        vae = diffusers_pipe.vae
        for method in ("encode", "decode"):
            monkeypatch.setattr(vae, method, self._wrap(f"vae.{method}", getattr(vae, method)))

    def _hook(self, name, module):
        def count(*_args, **_kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1

        return module.register_forward_pre_hook(count)

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.fixture
def t2v_work(t2v, monkeypatch):
    counter = WorkCounter(t2v, monkeypatch)
    yield counter
    counter.remove()


@pytest.fixture
def ti2v_work(ti2v, monkeypatch):
    counter = WorkCounter(ti2v, monkeypatch)
    yield counter
    counter.remove()


# --------------------------------------------------------------------------------------------- text-to-video


def test_loads_the_saved_wan_pipeline_on_cpu(t2v, tiny_wan_dir):
    assert type(t2v.diffusers_pipeline).__name__ == "WanPipeline"
    assert t2v.device == "cpu"
    assert t2v.rules.family == "WanPipeline"
    assert t2v.rules.temporal_factor == 4
    assert t2v.rules.spatial_multiple == 16
    assert len(t2v.transformers) == 1
    assert str(tiny_wan_dir) in repr(t2v)


@pytest.mark.parametrize("num_frames", [1, 9, 17])
def test_text_to_video_renders_uint8_frames(t2v, num_frames):
    out = t2v(PROMPT, num_frames=num_frames, guidance_scale=5.0, seed=0, **SMALL)

    assert isinstance(out, VideoOutput)
    assert out.frames.dtype == np.uint8
    assert out.frames.shape == (num_frames, 32, 32, 3)
    assert out.frames.std() > 5  # random weights still give a picture, not a constant
    assert out.settings["num_frames"] == num_frames
    assert out.settings["prompt"] == PROMPT and out.settings["seed"] == 0
    assert out.stats.num_inference_steps == 2


def test_same_seed_gives_identical_frames_and_another_seed_differs(t2v):
    first = t2v(PROMPT, num_frames=9, seed=123, **SMALL).frames
    again = t2v(PROMPT, num_frames=9, seed=123, **SMALL).frames
    other = t2v(PROMPT, num_frames=9, seed=124, **SMALL).frames

    np.testing.assert_array_equal(first, again)
    assert np.abs(first.astype(np.int16) - other.astype(np.int16)).mean() > 1.0


def test_a_generator_argument_works_like_a_seed(t2v):
    import torch

    by_seed = t2v(PROMPT, num_frames=5, seed=7, **SMALL).frames
    by_generator = t2v(PROMPT, num_frames=5, generator=torch.Generator().manual_seed(7), **SMALL).frames
    np.testing.assert_array_equal(by_seed, by_generator)


def test_the_prompt_changes_the_output(t2v):
    red = t2v("a red circle moving right", num_frames=5, seed=0, **SMALL).frames
    blue = t2v("a blue square moving up", num_frames=5, seed=0, **SMALL).frames
    assert not np.array_equal(red, blue)


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_stats_count_transformer_calls_with_and_without_guidance(t2v, steps):
    guided = t2v(PROMPT, num_frames=5, height=32, width=32, num_inference_steps=steps, guidance_scale=5.0, seed=0)
    unguided = t2v(PROMPT, num_frames=5, height=32, width=32, num_inference_steps=steps, guidance_scale=1.0, seed=0)

    assert guided.stats.transformer_calls == 2 * steps  # conditional + unconditional pass per step
    assert unguided.stats.transformer_calls == steps
    for out in (guided, unguided):
        assert out.stats.seconds > 0
        assert out.stats.num_inference_steps == steps
        assert out.stats.device == "cpu"
        assert out.stats.peak_memory_mb > 0


def test_a_list_of_prompts_gives_one_output_each(t2v):
    outs = t2v([PROMPT, "a blue square moving up"], num_frames=5, seed=0, **SMALL)
    assert isinstance(outs, list) and len(outs) == 2
    assert all(o.frames.shape == (5, 32, 32, 3) for o in outs)
    assert not np.array_equal(outs[0].frames, outs[1].frames)


@pytest.mark.parametrize("bad, message", [
    (dict(num_frames=0), r"num_frames=0"),
    (dict(num_frames=15), r"num_frames=15.*\b17\b"),
    (dict(num_frames=16), r"num_frames=16.*\b17\b"),
    (dict(height=481), r"height=481.*\b16\b.*\b480\b"),
    (dict(width=40), r"width=40.*\b16\b"),
    (dict(num_inference_steps=0), r"num_inference_steps"),
    (dict(guidance_scale=-1.0), r"guidance_scale"),
    (dict(prompt="  "), r"prompt"),
])
def test_invalid_inputs_raise_before_any_model_call(t2v, t2v_work, bad, message):
    kwargs = dict(num_frames=9, guidance_scale=5.0, seed=0, **SMALL)
    kwargs.update(bad)
    prompt = kwargs.pop("prompt", PROMPT)
    with pytest.raises(ValueError, match=re.compile(message, re.S)):
        t2v(prompt, **kwargs)
    assert t2v_work.calls == {}


def test_the_work_counter_sees_a_valid_call(t2v, t2v_work):
    # Guards the test above: the same counter does see a real call.
    t2v(PROMPT, num_frames=5, guidance_scale=5.0, seed=0, **SMALL)
    assert t2v_work.calls["transformer"] == 4
    assert t2v_work.calls["text_encoder"] >= 1
    assert t2v_work.calls["vae.decode"] == 1


@pytest.mark.parametrize("bad", [dict(height=32.0), dict(num_frames="9"), dict(seed=1.5), dict(seed=True)])
def test_wrongly_typed_inputs_raise_type_error_before_any_model_call(t2v, t2v_work, bad):
    kwargs = dict(num_frames=9, seed=0, **SMALL)
    kwargs.update(bad)
    with pytest.raises(TypeError):
        t2v(PROMPT, **kwargs)
    assert t2v_work.calls == {}


def test_output_saves_a_playable_mp4(t2v, tmp_path):
    out = t2v(PROMPT, num_frames=9, seed=0, **SMALL)
    path = out.save(tmp_path / "x.mp4")

    assert path.is_file()
    info = ffmpeg_stream_info(path)
    assert (info["codec"], info["pix_fmt"], info["frames"]) == ("h264", "yuv420p", 9)
    assert info["fps"] == pytest.approx(out.fps)
    atoms = mp4_top_level_atoms(path.read_bytes())
    assert atoms.index("moov") < atoms.index("mdat")
    assert out.save(tmp_path / "x.gif", fps=4).is_file()


def test_save_pretrained_round_trip_gives_identical_frames(t2v, tmp_path):
    t2v.diffusers_pipeline.save_pretrained(str(tmp_path / "copy"))
    reloaded = quiet(TextToVideoPipeline.from_pretrained(tmp_path / "copy", device="cpu"))

    expected = t2v(PROMPT, num_frames=9, seed=5, **SMALL).frames
    np.testing.assert_array_equal(reloaded(PROMPT, num_frames=9, seed=5, **SMALL).frames, expected)


@pytest.mark.parametrize("form", ["vae_dtype", "dict"])
def test_the_vae_alone_can_run_in_bfloat16(t2v, tiny_wan_dir, form):
    import torch

    from metainfer_gen.video.quality import psnr

    kwargs = ({"vae_dtype": torch.bfloat16} if form == "vae_dtype"
              else {"torch_dtype": {"vae": torch.bfloat16, "default": torch.float32}})  # diffusers' own form
    mixed = quiet(TextToVideoPipeline.from_pretrained(tiny_wan_dir, device="cpu", **kwargs))
    parts = mixed.diffusers_pipeline
    assert parts.vae.dtype == torch.bfloat16
    assert parts.transformer.dtype == torch.float32 and parts.text_encoder.dtype == torch.float32
    out = mixed(PROMPT, num_frames=5, seed=5, **SMALL)
    expected = t2v(PROMPT, num_frames=5, seed=5, **SMALL).frames
    assert out.frames.dtype == np.uint8 and out.frames.shape == expected.shape
    assert psnr(out.frames, expected) > 35  # the same clip, decoded at bf16 precision
    if form == "dict":  # image-to-video: the reference image is encoded by the bf16 VAE too
        image = quiet(ImageToVideoPipeline.from_pipe(mixed))
        assert image(random_image(), PROMPT, num_frames=5, seed=5, **SMALL).frames.shape == expected.shape


def test_the_settings_file_fixes_the_prompt_length_the_model_was_trained_at(t2v, tmp_path):
    import json

    from metainfer_gen.pipelines.loading import SETTINGS_FILE

    t2v.diffusers_pipeline.save_pretrained(str(tmp_path / "short"))
    (tmp_path / "short" / SETTINGS_FILE).write_text(json.dumps({"max_sequence_length": 8}))
    short = quiet(TextToVideoPipeline.from_pretrained(tmp_path / "short", device="cpu"))
    lengths = []
    short.diffusers_pipeline.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: lengths.append(kw["encoder_hidden_states"].shape[1]), with_kwargs=True)

    out = short(PROMPT, num_frames=5, seed=5, **SMALL)
    assert set(lengths) == {8}  # the prompt embedding the transformer reads: 8 rows, not diffusers' 512
    np.testing.assert_array_equal(out.frames, t2v(PROMPT, num_frames=5, seed=5, max_sequence_length=8, **SMALL).frames)
    assert not np.array_equal(out.frames, t2v(PROMPT, num_frames=5, seed=5, **SMALL).frames)
    short(PROMPT, num_frames=5, seed=5, max_sequence_length=12, **SMALL)  # an explicit argument wins
    assert lengths[-1] == 12


def test_missing_path_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        TextToVideoPipeline.from_pretrained(tmp_path / "missing", device="cpu")
    with pytest.raises(FileNotFoundError):
        ImageToVideoPipeline.from_pretrained(str(tmp_path / "missing"), device="cpu")


def test_folder_without_model_index_raises_file_not_found(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        TextToVideoPipeline.from_pretrained(tmp_path / "empty", device="cpu")


def test_sizes_beyond_the_position_table_raise_instead_of_crashing_in_the_model(t2v, t2v_work):
    # Same weights, but Wan's rotary table covers only 8 patches per axis: 64 pixels, 29 frames.
    from diffusers import WanPipeline, WanTransformer3DModel

    base = t2v.diffusers_pipeline
    transformer = WanTransformer3DModel.from_config({**base.transformer.config, "rope_max_seq_len": 8}).eval()
    transformer.load_state_dict(base.transformer.state_dict())
    short = quiet(TextToVideoPipeline(WanPipeline(
        tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae, transformer=transformer,
        scheduler=base.scheduler, expand_timesteps=True,
    )))

    assert short(PROMPT, num_frames=1, height=64, width=32, num_inference_steps=1).frames.shape == (1, 64, 32, 3)
    assert short(PROMPT, num_frames=29, height=32, width=32, num_inference_steps=1).frames.shape[0] == 29
    calls_before = dict(t2v_work.calls)
    with pytest.raises(ValueError, match=r"height=80.*\b64\b"):
        short(PROMPT, num_frames=1, height=80, width=32, num_inference_steps=1)
    with pytest.raises(ValueError, match=r"num_frames=33.*\b29\b"):
        short(PROMPT, num_frames=33, height=32, width=32, num_inference_steps=1)
    assert t2v_work.calls == calls_before  # shared text encoder / VAE: nothing ran for the refused calls


def test_text_to_video_from_a_wan21_i2v_checkpoint_names_the_right_class(tiny_wan_i2v_dir):
    with pytest.raises(ValueError, match="ImageToVideoPipeline"):
        TextToVideoPipeline.from_pretrained(tiny_wan_i2v_dir, device="cpu")


# -------------------------------------------------------------------------------------------- image-to-video


def test_ti2v_checkpoint_converts_to_image_to_video_sharing_its_weights(ti2v, t2v):
    import torch

    pipe = ti2v.diffusers_pipeline
    assert type(pipe).__name__ == "WanImageToVideoPipeline"
    assert pipe.config.expand_timesteps is True
    assert pipe.image_encoder is None
    assert ti2v.rules.temporal_factor == 4 and ti2v.rules.spatial_multiple == 16
    for a, b in zip(pipe.transformer.parameters(), t2v.diffusers_pipeline.transformer.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("num_frames", [1, 9])
def test_ti2v_renders_and_its_first_frame_is_the_vae_round_trip_of_the_image(ti2v, num_frames):
    import torch

    image = random_image(seed=1)
    out = ti2v(image, PROMPT, num_frames=num_frames, seed=0, **SMALL)
    assert out.frames.shape == (num_frames, 32, 32, 3) and out.frames.dtype == np.uint8
    assert out.settings["image_size"] == [32, 32]

    # The first latent frame is the clean image latent, so the first frame is decode(encode(image)).
    vae = ti2v.diffusers_pipeline.vae
    x = torch.from_numpy(image).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0  # (1, 3, 1, H, W)
    with torch.no_grad():
        latent = vae.encode(x).latent_dist.mode()
        decoded = vae.decode(latent).sample[0, :, 0]  # (3, H, W) in [-1, 1]
    expected = ((decoded.clamp(-1, 1) + 1) / 2 * 255 + 0.5).floor().to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.abs(out.frames[0].astype(np.int16) - expected.astype(np.int16)).max() <= 1


def test_ti2v_output_follows_the_image(ti2v):
    # A dark and a bright picture: the random VAE blurs noise, but keeps brightness apart.
    dark, bright = random_image(seed=1) // 2, 128 + random_image(seed=2) // 2
    a = ti2v(dark, PROMPT, num_frames=5, seed=0, **SMALL).frames
    b = ti2v(bright, PROMPT, num_frames=5, seed=0, **SMALL).frames
    again = ti2v(dark, PROMPT, num_frames=5, seed=0, **SMALL).frames

    np.testing.assert_array_equal(a, again)
    assert np.abs(a[0].astype(np.int16) - b[0].astype(np.int16)).mean() > 5
    assert not np.array_equal(a[1:], b[1:])  # the later frames are conditioned on the image too


def test_ti2v_counts_transformer_calls(ti2v):
    assert ti2v(random_image(), PROMPT, num_frames=5, guidance_scale=5.0, seed=0, **SMALL).stats.transformer_calls == 4
    assert ti2v(random_image(), PROMPT, num_frames=5, guidance_scale=1.0, seed=0, **SMALL).stats.transformer_calls == 2


@pytest.mark.parametrize("image", [
    np.random.default_rng(3).integers(0, 256, (20, 50, 4), dtype=np.uint8),  # RGBA, wide
    np.random.default_rng(4).integers(0, 256, (70, 30), dtype=np.uint8),  # gray, tall
])
def test_image_to_video_takes_any_mode_and_size(ti2v, image):
    out = ti2v(image, PROMPT, num_frames=5, height=32, width=48, num_inference_steps=2, seed=0)
    assert out.frames.shape == (5, 32, 48, 3)
    assert out.settings["image_size"] == [48, 32]


def test_image_to_video_accepts_a_path(ti2v, tmp_path):
    from PIL import Image

    Image.fromarray(random_image(seed=6)).save(tmp_path / "ref.png")
    by_path = ti2v(tmp_path / "ref.png", PROMPT, num_frames=5, seed=0, **SMALL).frames
    by_array = ti2v(random_image(seed=6), PROMPT, num_frames=5, seed=0, **SMALL).frames
    np.testing.assert_array_equal(by_path, by_array)


@pytest.mark.parametrize("bad, error", [
    (dict(num_frames=16), ValueError),
    (dict(height=481), ValueError),
    (dict(num_inference_steps=0), ValueError),
    (dict(image="missing.png"), FileNotFoundError),
    (dict(image=np.random.default_rng(0).random((32, 32, 3))), ValueError),
    (dict(prompt=["a", "b"]), TypeError),
])
def test_image_to_video_refuses_bad_inputs_before_any_model_call(ti2v, ti2v_work, tmp_path, bad, error):
    kwargs = dict(image=random_image(), prompt=PROMPT, num_frames=9, seed=0, **SMALL)
    kwargs.update(bad)
    image, prompt = kwargs.pop("image"), kwargs.pop("prompt")
    if isinstance(image, str):
        image = tmp_path / image  # a file that does not exist
    with pytest.raises(error):
        ti2v(image, prompt, **kwargs)
    assert ti2v_work.calls == {}


@pytest.mark.parametrize("num_frames", [1, 9])
def test_wan21_i2v_checkpoint_loads_natively_and_renders(i2v21, num_frames):
    pipe = i2v21.diffusers_pipeline
    assert type(pipe).__name__ == "WanImageToVideoPipeline"
    assert not pipe.config.expand_timesteps
    assert pipe.transformer.config.in_channels == 2 * pipe.vae.config.z_dim + 4

    out = i2v21(random_image(seed=1), PROMPT, num_frames=num_frames, guidance_scale=5.0, seed=0, **SMALL)
    assert out.frames.shape == (num_frames, 32, 32, 3) and out.frames.dtype == np.uint8
    assert out.stats.transformer_calls == 4


def test_wan21_i2v_output_depends_on_image_and_seed(i2v21):
    a = i2v21(random_image(seed=1), PROMPT, num_frames=5, seed=0, **SMALL).frames
    again = i2v21(random_image(seed=1), PROMPT, num_frames=5, seed=0, **SMALL).frames
    other_image = i2v21(random_image(seed=2), PROMPT, num_frames=5, seed=0, **SMALL).frames
    other_seed = i2v21(random_image(seed=1), PROMPT, num_frames=5, seed=1, **SMALL).frames

    np.testing.assert_array_equal(a, again)
    assert not np.array_equal(a, other_image)
    assert not np.array_equal(a, other_seed)


def test_converted_i2v_round_trips_and_converts_back_to_the_same_t2v(ti2v, t2v, tmp_path):
    ti2v.diffusers_pipeline.save_pretrained(str(tmp_path / "i2v"))

    reloaded = quiet(ImageToVideoPipeline.from_pretrained(tmp_path / "i2v", device="cpu"))
    assert type(reloaded.diffusers_pipeline).__name__ == "WanImageToVideoPipeline"
    image = random_image(seed=9)
    np.testing.assert_array_equal(reloaded(image, PROMPT, num_frames=5, seed=3, **SMALL).frames,
                                  ti2v(image, PROMPT, num_frames=5, seed=3, **SMALL).frames)

    # The saved TI2V-style I2V checkpoint still serves text-to-video, with the same result as the original.
    back = quiet(TextToVideoPipeline.from_pretrained(tmp_path / "i2v", device="cpu"))
    assert type(back.diffusers_pipeline).__name__ == "WanPipeline"
    np.testing.assert_array_equal(back(PROMPT, num_frames=5, seed=3, **SMALL).frames,
                                  t2v(PROMPT, num_frames=5, seed=3, **SMALL).frames)


@pytest.mark.parametrize("hub_id", ["Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Lightricks/LTX-Video-0.9.5"])
def test_hub_ids_with_dots_reach_diffusers_and_are_not_taken_for_missing_paths(hub_id, monkeypatch):
    import diffusers

    from metainfer_gen.pipelines.loading import TEXT_TO_VIDEO, load_diffusers_pipeline

    seen = []

    def fake_from_pretrained(source, **kwargs):
        seen.append(source)
        raise OSError("offline")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", fake_from_pretrained)
    with pytest.raises(OSError, match="offline"):
        load_diffusers_pipeline(hub_id, TEXT_TO_VIDEO, device="cpu")
    assert seen == [hub_id]


@pytest.mark.parametrize("path", ["./no/such/dir", "/no/such/dir", "~/no/such/dir"])
def test_missing_local_paths_raise_file_not_found(path):
    from metainfer_gen.pipelines.loading import TEXT_TO_VIDEO, load_diffusers_pipeline

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_diffusers_pipeline(path, TEXT_TO_VIDEO, device="cpu")


@pytest.mark.parametrize("name", ["default", "a/b/c"])
def test_a_bare_name_is_neither_a_folder_nor_a_hub_id(name):
    from metainfer_gen.pipelines.loading import TEXT_TO_VIDEO, load_diffusers_pipeline

    with pytest.raises(FileNotFoundError, match="neither an existing pipeline folder nor a hub id"):
        load_diffusers_pipeline(name, TEXT_TO_VIDEO, device="cpu")
