"""The demo's backend on tiny models (no browser): clips, stats, cache switching, images of any mode, the LLM,
loading from the CLI flags, and the page's tabs."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from PIL import Image

from metainfer_gen.apps.demo_backend import DemoBackend, cache_choices
from metainfer_gen.apps.demo_limits import DemoLimits, InputError
from metainfer_gen.video.cache.config import PRESET_MIN_INFERENCE_STEPS, PRESET_MIN_UNGUIDED_INFERENCE_STEPS
from metainfer_gen.video.export import read_video

SMALL = dict(num_frames=5, height=32, width=32, num_inference_steps=4, guidance_scale=1.0, seed=0)
PROMPT = "a red circle moving right"
MAX_STEPS = PRESET_MIN_INFERENCE_STEPS  # the presets reuse from there on


@pytest.fixture(scope="module")
def backend(tiny_wan_dir, tmp_path_factory):
    from metainfer_gen import pipelines

    t2v = pipelines.TextToVideoPipeline.from_pretrained(str(tiny_wan_dir), device="cpu")
    i2v = pipelines.ImageToVideoPipeline.from_pipe(t2v)  # shares the transformer, so the cache hooks too
    for pipe in (t2v, i2v):
        pipe.set_progress_bar_config(disable=True)
    return DemoBackend(t2v=t2v, i2v=i2v, llm=None, output_dir=tmp_path_factory.mktemp("clips"),
                       limits=DemoLimits(max_frames=9, max_size=64, max_steps=MAX_STEPS))


def t2v(backend, cache="off", progress=None, **overrides):
    values = {**SMALL, **overrides}
    return backend.text_to_video(PROMPT, "", values["num_frames"], values["height"], values["width"],
                                 values["num_inference_steps"], values["guidance_scale"], values["seed"], cache,
                                 progress=progress)


def test_a_clip_is_written_as_mp4_with_stats_and_progress(backend):
    steps = []
    result = t2v(backend, progress=lambda done, total: steps.append((done, total)))
    assert result.path.suffix == ".mp4" and result.path.parent == backend.output_dir
    assert read_video(result.path).shape == (5, 32, 32, 3)
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert "for 5 frames at 32x32, 4 steps, 4 transformer calls" in \
        result.stats_text
    assert "step cache off: every step computed" in result.stats_text
    assert result.audit_text.startswith("fast-path audit: no registry kernel ran")


def test_a_cached_run_reports_reuse_and_speedup_against_the_uncached_run_of_the_same_settings(backend):
    steps = PRESET_MIN_INFERENCE_STEPS
    t2v(backend, cache="off", seed=1, num_inference_steps=steps)
    fast = t2v(backend, cache="fast", seed=2, num_inference_steps=steps)  # another seed: the same settings
    lines = fast.stats_text.splitlines()
    assert any(line.startswith("step cache fast: ") and "transformer calls reused" in line for line in lines)
    speed = [line for line in lines if line.startswith("speedup ")]
    assert speed and "x against the last uncached run of these settings" in speed[0]
    other = t2v(backend, cache="fast", num_frames=9, num_inference_steps=steps)  # nothing to compare with yet
    assert "speedup: no uncached run of these settings yet" in other.stats_text


def test_a_preset_below_its_floor_says_it_stood_aside(backend):
    few = t2v(backend, cache="fast", num_inference_steps=4, guidance_scale=4.0)
    assert f"step cache fast: stood aside (num_inference_steps=4 is below min_inference_steps=" \
           f"{PRESET_MIN_INFERENCE_STEPS}" in few.stats_text
    unguided = t2v(backend, cache="fast", num_inference_steps=4)  # guidance 1: the lower unguided floor
    assert "step cache fast: stood aside (num_inference_steps=4 is below min_unguided_inference_steps=" \
           f"{PRESET_MIN_UNGUIDED_INFERENCE_STEPS}" in unguided.stats_text


def test_baseline_policies_report_block_evaluations(backend):
    t2v(backend, cache="off")
    result = t2v(backend, cache="fbcache")
    assert "step cache fbcache" in result.stats_text and "block evaluations" in result.stats_text


def test_switching_between_tabs_moves_the_shared_cache(backend):
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    t2v(backend, cache="auto")
    assert backend.t2v.step_cache is not None
    result = backend.image_to_video(image, PROMPT, None, *SMALL.values(), "quality")
    assert backend.t2v.step_cache is None and backend.i2v.step_cache.name == "quality"
    assert "step cache quality" in result.stats_text
    t2v(backend, cache="off")
    assert backend.t2v.step_cache is None and backend.i2v.step_cache is None


@pytest.mark.parametrize("mode, size", [("RGBA", (130, 90)), ("L", (40, 100)), ("P", (64, 64)), ("RGB", (33, 17))])
def test_images_of_any_mode_and_size_are_fitted_and_the_size_reported(backend, mode, size):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)
    result = backend.image_to_video(image, PROMPT, None, *SMALL.values(), "off")
    assert result.image_text == (f"reference image {size[0]}x{size[1]} {mode}, centre-cropped and resized to "
                                 "32x32")
    assert read_video(result.path).shape == (5, 32, 32, 3)


@pytest.mark.parametrize("overrides, words", [
    (dict(num_frames=13), "num_frames=13 is outside this demo's range 1..9"),
    (dict(height=128), "height=128 is outside this demo's range 1..64"),
    (dict(num_inference_steps=MAX_STEPS + 1),
     f"num_inference_steps={MAX_STEPS + 1} is outside this demo's range 1..{MAX_STEPS}"),
    (dict(num_frames=6), "num_frames=6 is not valid for WanPipeline: it must be k\\*4\\+1"),
    (dict(width=40), "width=40 is not valid for WanPipeline"),
])
def test_requests_outside_the_limits_or_the_model_rules_are_refused_before_any_work(backend, overrides, words):
    before = sorted(backend.output_dir.iterdir())
    with pytest.raises(InputError, match=words):
        t2v(backend, **overrides)
    assert sorted(backend.output_dir.iterdir()) == before


def test_unknown_cache_no_image_and_missing_models_are_clear_errors(backend):
    with pytest.raises(InputError, match="unknown cache policy 'turbo'"):
        t2v(backend, cache="turbo")
    with pytest.raises(InputError, match="upload a reference image first"):
        backend.image_to_video(None, PROMPT, None, *SMALL.values(), "off")
    with pytest.raises(InputError, match="this demo has no LLM"):
        backend.generate_text("hello", 4, 0.0)
    assert cache_choices()[:2] == ["off", "auto"]


def test_old_clips_are_deleted_beyond_the_kept_number(backend, monkeypatch):
    import metainfer_gen.apps.demo_backend as module

    monkeypatch.setattr(module, "NUM_KEPT_CLIPS", 2)
    paths = [t2v(backend, num_inference_steps=1).path for _ in range(3)]
    assert not paths[0].exists() and paths[1].exists() and paths[2].exists()


def test_llm_completion_reports_ttft_and_tokens_per_second(text_checkpoint, tmp_path):
    from metainfer_gen import pipelines

    _, tokenizer, path = text_checkpoint
    llm = pipelines.TextGenerationPipeline.from_pretrained(path, device="cpu")
    expected = tokenizer.decode(llm("the quick brown fox", max_new_tokens=6).token_ids)
    backend = DemoBackend(t2v=None, i2v=None, llm=llm, output_dir=tmp_path, limits=DemoLimits(max_new_tokens=8))
    try:
        result = backend.generate_text("the quick brown fox", 6, 0.0)
        assert result.stats_text.startswith("6 tokens, TTFT ") and "tokens/s after the first, finish: length" in \
            result.stats_text
        assert result.text == expected
        with pytest.raises(InputError, match="max_new_tokens=9 is outside this demo's range 1..8"):
            backend.generate_text("the quick brown fox", 9, 0.0)
    finally:
        backend.close()
    assert not backend._llm._front  # closed: the engine thread is gone


def test_concurrent_llm_requests_share_engine_steps_and_answer_as_alone(text_checkpoint, tmp_path):
    import threading
    import time

    from metainfer_gen import pipelines

    llm = pipelines.TextGenerationPipeline.from_pretrained(text_checkpoint[2], device="cpu")
    prompts = ["the quick brown fox", "hello world"]
    backend = DemoBackend(t2v=None, i2v=None, llm=llm, output_dir=tmp_path, limits=DemoLimits(max_new_tokens=8))
    batch_sizes, run = [], llm.engine.runner.run

    def slow_run(out):  # 20 ms a step: both requests are surely queued before the first one ends
        batch_sizes.append(len(out.scheduled))
        time.sleep(0.02)
        return run(out)

    try:
        alone = [backend.generate_text(p, 8, 0.0).text for p in prompts]
        llm.engine.runner.run = slow_run
        results: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: results.update({i: backend.generate_text(prompts[i], 8,
                                                                                                0.0).text}))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        backend.close()
    assert [results[0], results[1]] == alone
    assert max(batch_sizes) == 2 and len(batch_sizes) < 2 * 8  # one forward for both; fewer steps than in turn


def demo_args(**overrides) -> argparse.Namespace:
    from metainfer_gen.apps.cli import build_parser

    argv = ["demo", "--device", "cpu"]
    for name, value in overrides.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return build_parser().parse_args(argv)


def test_demo_flags_default_to_loopback_and_the_limits():
    args = demo_args()
    assert (args.host, args.port, args.share, args.max_frames, args.max_size) == ("127.0.0.1", 7860, False, 33, 256)


def test_an_i2v_only_checkpoint_as_the_main_model_is_a_clear_error(tiny_wan_i2v_dir, tmp_path):
    from metainfer_gen.apps.demo import load_backend

    with pytest.raises(ValueError, match="text-to-video"):
        load_backend(demo_args(model=tiny_wan_i2v_dir, no_llm=True), tmp_path)


def test_the_image_tab_is_left_out_with_a_note_when_the_model_cannot_animate_images(tiny_wan_dir, tmp_path,
                                                                                      monkeypatch):
    from metainfer_gen import pipelines
    from metainfer_gen.apps.demo import load_backend

    def refuse(cls, other):
        raise ValueError("WanPipeline (Wan 2.1 T2V) cannot do image-to-video")

    monkeypatch.setattr(pipelines.ImageToVideoPipeline, "from_pipe", classmethod(refuse))
    backend = load_backend(demo_args(model=tiny_wan_dir, no_llm=True), tmp_path)
    assert backend.i2v is None and backend.llm is None
    assert backend.notes == ["Image-to-video is not shown: WanPipeline (Wan 2.1 T2V) cannot do image-to-video "
                             "(give --i2v-model)"]


def test_an_i2v_only_checkpoint_serves_the_image_tab_next_to_a_t2v_model(tiny_wan_dir, tiny_wan_i2v_dir, tmp_path,
                                                                          monkeypatch):
    from metainfer_gen.apps.demo import load_backend
    from metainfer_gen.pipelines import text_generation

    # The embedded LLM may not be built yet; point its folder at an empty one so the tab is hidden either way.
    monkeypatch.setattr(text_generation, "DEFAULT_LLM_DIR", "no_such_llm")
    backend = load_backend(demo_args(model=tiny_wan_dir, i2v_model=tiny_wan_i2v_dir), tmp_path)
    assert backend.i2v.diffusers_pipeline.transformer is not backend.t2v.diffusers_pipeline.transformer
    assert backend.llm is None
    assert any(note.startswith("The LLM tab is not shown: FileNotFoundError: ") for note in backend.notes)
    result = backend.image_to_video(Image.new("RGB", (32, 32)), PROMPT, None, *SMALL.values(), "off")
    assert read_video(result.path).shape == (5, 32, 32, 3)


def test_vae_dtype_puts_both_tabs_vae_alone_in_bfloat16(tiny_wan_dir, tiny_wan_i2v_dir, tmp_path):
    import torch

    from metainfer_gen.apps.demo import load_backend

    backend = load_backend(demo_args(model=tiny_wan_dir, i2v_model=tiny_wan_i2v_dir, no_llm=True,
                                     vae_dtype="bfloat16"), tmp_path)
    for pipe in (backend.t2v, backend.i2v):
        parts = pipe.diffusers_pipeline
        assert (parts.vae.dtype, parts.transformer.dtype) == (torch.bfloat16, torch.float32)
    result = backend.text_to_video(PROMPT, None, *SMALL.values(), "off")
    assert read_video(result.path).shape == (5, 32, 32, 3)


def test_an_explicit_llm_that_fails_to_load_is_an_error(tiny_wan_dir, tmp_path):
    from metainfer_gen.apps.demo import load_backend

    with pytest.raises(FileNotFoundError):
        load_backend(demo_args(model=tiny_wan_dir, llm_model=tmp_path / "missing"), tmp_path)


def test_the_page_shows_one_tab_per_loaded_model(backend):
    pytest.importorskip("gradio")
    from metainfer_gen.apps.gradio_app import build_app

    config = build_app(backend).get_config_file()
    tabs = [c["props"].get("label") for c in config["components"] if c.get("type") == "tabitem"]
    assert tabs == ["Text to video", "Image to video"]  # no LLM loaded: no LLM tab
    ids = {c["props"].get("elem_id") for c in config["components"]}
    assert {"t2v-generate", "i2v-image", "i2v-generate"} <= ids and "llm-generate" not in ids
    assert not any("lora" in str(c["props"].get("label", "")).lower() for c in config["components"])
    # gradio shows a progress bar only for functions whose signature has a gr.Progress default (read through
    # the error wrapper's __wrapped__).
    import inspect

    import gradio as gr

    app = build_app(backend)
    generate = [f.fn for f in app.fns.values() if f.api_name == "t2v_generate"]
    assert len(generate) == 1
    assert isinstance(inspect.signature(generate[0]).parameters["progress"].default, gr.Progress)
    with pytest.raises(ValueError, match="no model to show"):
        build_app(DemoBackend(t2v=None, i2v=None, llm=None, output_dir=backend.output_dir))


def test_warm_up_runs_each_model_once_and_leaves_no_clip(backend):
    calls = []
    handle = backend.t2v.transformers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    before = sorted(backend.output_dir.iterdir())
    try:
        backend.warm_up()
    finally:
        handle.remove()
    assert sorted(backend.output_dir.iterdir()) == before
    assert len(calls) == 4  # T2V and I2V (one shared transformer), 1 step each, CFG's two branches


def test_the_embedded_model_offers_the_shipped_demo_loras_and_another_model_none(tiny_wan_dir, tmp_path):
    from metainfer_gen.apps.demo import load_backend
    from metainfer_gen.apps.demo_limits import list_loras

    embedded = load_backend(demo_args(no_llm=True), tmp_path)
    assert list_loras(embedded.lora_dir) == ["steps_4_8.safetensors", "style_navy.safetensors"]
    assert load_backend(demo_args(model=tiny_wan_dir, no_llm=True), tmp_path).lora_dir is None
