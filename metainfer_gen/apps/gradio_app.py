"""The Gradio demo: text-to-video, image-to-video and LLM tabs over one :class:`DemoBackend`.

Started by ``metainfer-gen demo`` (see ``apps/demo.py``). This module only lays out controls and turns
``InputError`` into a message in the page; the work and every check live in ``demo_backend`` / ``demo_limits``.
A tab appears only when its model loaded: no control here does nothing.
"""

from __future__ import annotations

import functools
from typing import Any

from metainfer_gen.apps.demo_backend import IMAGE_TO_VIDEO, TEXT_TO_VIDEO, DemoBackend, cache_choices

# Element ids the browser test (and anyone scripting the page) addresses; "<tab>-<control>".
VIDEO_TABS = {TEXT_TO_VIDEO: ("t2v", "Text to video"), IMAGE_TO_VIDEO: ("i2v", "Image to video")}
LLM_TAB = ("llm", "LLM")
DEFAULT_CACHE = "auto"
# Video pipelines are not thread-safe: one call at a time. LLM calls queue on the async front, whose engine batches
# them, so as many run as the engine decodes at once (more wait in the engine's queue, not Gradio's).
CONCURRENCY = {"video": 1}


def _gradio():
    import gradio as gr

    return gr


def _errors_to_page(fn):
    """Run ``fn``; a ValueError/TypeError/FileNotFoundError becomes a ``gr.Error`` the page shows as a toast."""
    gr = _gradio()

    @functools.wraps(fn)  # gradio reads the signature through __wrapped__ to inject gr.Progress
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise gr.Error(str(exc), print_exception=False) from None

    return wrapped


def _video_tab(backend: DemoBackend, task: str) -> None:
    """Controls and outputs of one video tab (inside an open ``gr.Tab``)."""
    gr = _gradio()
    pipe = backend.video_pipeline(task)
    prefix, _ = VIDEO_TABS[task]
    limits, rules = backend.limits, pipe.rules
    frames_step, size_step = rules.temporal_factor, rules.spatial_multiple
    max_frames = (limits.max_frames - 1) // frames_step * frames_step + 1
    max_size = max(size_step, limits.max_size // size_step * size_step)

    def default(name: str, upper: int) -> int:
        return min(int(pipe.default(name)), upper)

    with gr.Row():
        with gr.Column():
            image = None
            if task == IMAGE_TO_VIDEO:
                # image_mode=None keeps the uploaded mode (RGBA, L, P...): our loader composites and converts it.
                image = gr.Image(label="Reference image (first frame): any mode and size", type="pil",
                                 image_mode=None, sources=["upload", "clipboard"], elem_id=f"{prefix}-image")
            prompt = gr.Textbox(label="Prompt", lines=2, max_length=limits.max_prompt_chars,
                                placeholder="a red circle moving right", elem_id=f"{prefix}-prompt")
            negative = gr.Textbox(label="Negative prompt", max_length=limits.max_prompt_chars,
                                  elem_id=f"{prefix}-negative")
            with gr.Row():
                frames = gr.Slider(1, max_frames, step=frames_step, value=default("num_frames", max_frames),
                                   label=f"Frames (k*{frames_step}+1)", elem_id=f"{prefix}-frames")
                steps = gr.Slider(1, limits.max_steps, step=1, value=default("num_inference_steps", limits.max_steps),
                                  label="Steps", elem_id=f"{prefix}-steps")
            with gr.Row():
                height = gr.Slider(size_step, max_size, step=size_step, value=default("height", max_size),
                                   label="Height", elem_id=f"{prefix}-height")
                width = gr.Slider(size_step, max_size, step=size_step, value=default("width", max_size),
                                  label="Width", elem_id=f"{prefix}-width")
            with gr.Row():
                guidance = gr.Number(value=float(pipe.default("guidance_scale") or 1.0), minimum=0, maximum=30,
                                     label="Guidance scale (1 = off)", elem_id=f"{prefix}-guidance")
                seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id=f"{prefix}-seed")
                cache = gr.Dropdown(cache_choices(), value=DEFAULT_CACHE, label="Step cache",
                                    info="auto, quality, fast: ours; the others: baselines",
                                    elem_id=f"{prefix}-cache")
            loras = []
            if backend.lora_choices():  # a control only when there is a LoRA to choose
                with gr.Row():
                    loras = [gr.Dropdown(backend.lora_choices(), value=backend.lora_choices()[0], label="LoRA",
                                         elem_id=f"{prefix}-lora"),
                             gr.Slider(-2, 2, step=0.05, value=1.0, label="LoRA weight",
                                       elem_id=f"{prefix}-lora-weight")]
            button = gr.Button("Generate", variant="primary", elem_id=f"{prefix}-generate")
        with gr.Column():
            video = gr.Video(label="Clip (H.264 MP4)", format="mp4", autoplay=True, loop=True, interactive=False,
                             height=360, elem_id=f"{prefix}-video")
            image_info = gr.Textbox(label="Reference image", interactive=False, visible=image is not None,
                                    elem_id=f"{prefix}-image-info")
            stats = gr.Textbox(label="Stats", lines=4, interactive=False, elem_id=f"{prefix}-stats")
            audit = gr.Textbox(label="Fast-path audit", lines=3, interactive=False, elem_id=f"{prefix}-audit")

    def run(*values, progress=gr.Progress()):
        def report(done: int, total: int) -> None:
            progress((done, total), desc="denoising", unit="steps")

        progress(0, desc="starting")
        if task == IMAGE_TO_VIDEO:
            result = backend.image_to_video(*values, progress=report)
        else:
            result = backend.text_to_video(*values, progress=report)
        return str(result.path), result.image_text, result.stats_text, result.audit_text

    run.__name__ = prefix.replace("-", "_") + "_generate"
    inputs = ([image] if image is not None else []) + [prompt, negative, frames, height, width, steps, guidance,
                                                        seed, cache, *loras]
    button.click(_errors_to_page(run), inputs, [video, image_info, stats, audit], concurrency_id="video",
                 concurrency_limit=CONCURRENCY["video"], api_name=f"{prefix}_generate")


def _llm_tab(backend: DemoBackend) -> None:
    gr = _gradio()
    prefix = LLM_TAB[0]
    limits = backend.limits
    with gr.Row():
        with gr.Column():
            prompt = gr.Textbox(label="Prompt", lines=4, max_length=limits.max_prompt_chars,
                                elem_id=f"{prefix}-prompt")
            with gr.Row():
                tokens = gr.Slider(1, limits.max_new_tokens, step=1, value=min(64, limits.max_new_tokens),
                                   label="Max new tokens", elem_id=f"{prefix}-max-new-tokens")
                temperature = gr.Slider(0.0, 2.0, step=0.05, value=0.0, label="Temperature (0 = greedy)",
                                        elem_id=f"{prefix}-temperature")
            button = gr.Button("Generate", variant="primary", elem_id=f"{prefix}-generate")
        with gr.Column():
            text = gr.Textbox(label="Completion", lines=8, interactive=False, elem_id=f"{prefix}-text")
            stats = gr.Textbox(label="Stats", interactive=False, elem_id=f"{prefix}-stats")

    def llm_generate(prompt_text, max_new_tokens, temp):
        result = backend.generate_text(prompt_text, max_new_tokens, temp)
        return result.text, result.stats_text

    button.click(_errors_to_page(llm_generate), [prompt, tokens, temperature], [text, stats], concurrency_id="llm",
                 concurrency_limit=backend.llm.engine.config.max_num_seqs, api_name="llm_generate")


def build_app(backend: DemoBackend) -> Any:
    """The ``gr.Blocks`` page for ``backend``: one tab per loaded model, queue enabled with bounded size.

    Raises:
        ValueError: the backend has no model at all.
    """
    gr = _gradio()
    if backend.t2v is None and backend.i2v is None and backend.llm is None:
        raise ValueError("the demo has no model to show: load a video model or an LLM")
    # delete_cache: gradio's copies of uploads and clips older than an hour go, checked every hour.
    with gr.Blocks(title="metainfer-gen demo", delete_cache=(3600, 3600), analytics_enabled=False) as app:
        gr.Markdown("## metainfer-gen demo\nClips render on the loaded model with the chosen step cache; the stats "
                    "compare each cached run with the last uncached run of the same settings.")
        for task, (prefix, label) in VIDEO_TABS.items():
            if {TEXT_TO_VIDEO: backend.t2v, IMAGE_TO_VIDEO: backend.i2v}[task] is not None:
                with gr.Tab(label, id=prefix, elem_id=f"{prefix}-tab"):
                    _video_tab(backend, task)
        if backend.llm is not None:
            with gr.Tab(LLM_TAB[1], id=LLM_TAB[0], elem_id=f"{LLM_TAB[0]}-tab"):
                _llm_tab(backend)
        if backend.notes:
            gr.Markdown("\n".join(f"- {note}" for note in backend.notes))
    app.queue(max_size=backend.limits.max_queue, default_concurrency_limit=1)
    return app


def theme():
    """Gradio's default look with system fonts: the page loads nothing from outside the machine."""
    gr = _gradio()
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


def launch_app(app, *, host: str = "127.0.0.1", port: int | None = None, share: bool = False,
               max_upload_mb: int = 20, block: bool = True):
    """Serve ``app``; ``share=True`` asks gradio for a public link. Returns gradio's (app, local url, share url)."""
    return app.launch(server_name=host, server_port=port, share=share, max_file_size=f"{max_upload_mb}mb",
                      prevent_thread_lock=not block, show_error=True, theme=theme(), footer_links=["api"],
                      ssr_mode=False)
