"""The demo's work, without any UI: models loaded once per process, requests checked and run, results described.

The gradio app (``gradio_app.py``) only lays out controls and calls :class:`DemoBackend`; everything that can go
wrong with a request is decided here, and is tested without a browser.
"""

from __future__ import annotations

import importlib.util
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from metainfer_gen.apps.demo_limits import DemoLimits, InputError, check_lora, list_loras
from metainfer_gen.apps.demo_llm import DemoLLM
from metainfer_gen.apps.render import use_loras

ProgressFn = Callable[[int, int], None]  # (denoising steps done, total steps)

TEXT_TO_VIDEO = "text-to-video"
IMAGE_TO_VIDEO = "image-to-video"
NUM_KEPT_CLIPS = 32  # finished clips kept in the output folder; older ones are deleted
NO_LORA = "none"


def cache_choices() -> list[str]:
    """Step-cache policies offered in the UI; ``dbcache`` only when cache-dit is installed (no dead choices)."""
    from metainfer_gen.video.cache.policies import policy_names

    names = policy_names()
    if importlib.util.find_spec("cache_dit") is None:
        names = [n for n in names if n != "dbcache"]
    return names


@dataclass(slots=True)
class VideoResult:
    """One finished clip: where it is, and the texts the UI shows beside it."""

    path: Path
    stats_text: str
    audit_text: str
    image_text: str = ""


@dataclass(slots=True)
class TextResult:
    """One LLM completion and the timing line shown under it."""

    text: str
    stats_text: str


@dataclass(slots=True)
class _Uncached:
    seconds: float
    block_evaluations: int


@dataclass
class DemoBackend:
    """Pipelines shared by every browser session, and what each request needs around them.

    Attributes:
        t2v: a :class:`~metainfer_gen.pipelines.TextToVideoPipeline`, or None (tab hidden).
        i2v: an :class:`~metainfer_gen.pipelines.ImageToVideoPipeline`, or None (tab hidden); may share weights
            (and so step-cache hooks) with ``t2v``.
        llm: a :class:`~metainfer_gen.pipelines.TextGenerationPipeline`, or None (tab hidden).
        limits: input bounds. output_dir: where clips are written (a temporary folder of the demo).
        notes: why a tab is missing, for the page and the log.
        lora_dir: folder whose LoRA files the page offers (None: no LoRA control).
    """

    t2v: Any
    i2v: Any
    llm: Any
    output_dir: Path
    limits: DemoLimits = field(default_factory=DemoLimits)
    notes: list[str] = field(default_factory=list)
    lora_dir: Path | None = None

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # Pipelines are not thread-safe and T2V/I2V may share a transformer: one video call at a time.
        self._video_lock = threading.Lock()
        self._llm = DemoLLM(self.llm) if self.llm is not None else None
        self._cache_specs: dict[str, str] = {}  # task -> cache spec enabled on that pipeline
        self._uncached: dict[tuple, _Uncached] = {}
        self._clips: deque[Path] = deque()

    def warm_up(self) -> None:
        """One smallest call per model before serving.

        A fresh process's first call is seconds slower (allocator, lazy imports, one-time setup); without this
        the first uncached run would make every later speedup look better than it is.
        """
        from PIL import Image

        for pipe in (self.t2v, self.i2v):
            if pipe is not None:
                side = pipe.rules.spatial_multiple
                args = (Image.new("RGB", (side, side)), "warm up") if pipe is self.i2v else ("warm up",)
                with self._video_lock:
                    pipe(*args, num_frames=1, height=side, width=side, num_inference_steps=1, seed=0)
        if self._llm is not None:
            self._llm.complete("warm up", 1, 0.0)

    # ------------------------------------------------------------------------------------------------ video

    def video_pipeline(self, task: str):
        """The pipeline for ``task``; InputError when this demo has none."""
        pipe = {TEXT_TO_VIDEO: self.t2v, IMAGE_TO_VIDEO: self.i2v}.get(task)
        if pipe is None:
            raise InputError(f"this demo has no {task} model")
        return pipe

    def text_to_video(self, prompt: str, negative_prompt: str | None, num_frames, height, width,
                      num_inference_steps, guidance_scale, seed, cache: str = "off", lora: str = NO_LORA,
                      lora_weight=1.0, progress: ProgressFn | None = None) -> VideoResult:
        """Render a clip from text. Arguments as in the pipeline; ``cache`` is a step-cache spec; ``lora`` one of
        :meth:`lora_choices` at ``lora_weight`` (in [-2, 2]).

        Raises:
            InputError: an input outside the demo's limits or the model's rules, an unknown cache policy, or a
                LoRA that is not in the folder or does not load.
        """
        return self._video(TEXT_TO_VIDEO, None, prompt, negative_prompt, num_frames, height, width,
                           num_inference_steps, guidance_scale, seed, cache, progress, lora, lora_weight)

    def image_to_video(self, image, prompt: str, negative_prompt: str | None, num_frames, height, width,
                       num_inference_steps, guidance_scale, seed, cache: str = "off", lora: str = NO_LORA,
                       lora_weight=1.0, progress: ProgressFn | None = None) -> VideoResult:
        """Render a clip whose first frame is ``image`` (a PIL image of any mode and size, fitted to the grid).

        Raises:
            InputError: as :meth:`text_to_video`, or no image / too many pixels.
        """
        self.limits.check_image(image)
        return self._video(IMAGE_TO_VIDEO, image, prompt, negative_prompt, num_frames, height, width,
                           num_inference_steps, guidance_scale, seed, cache, progress, lora, lora_weight)

    def lora_choices(self) -> list[str]:
        """``["none", <LoRA files in lora_dir>...]``; empty when there is no folder or no file (no control)."""
        names = list_loras(self.lora_dir)
        return [NO_LORA, *names] if names else []

    def _lora_specs(self, name: str, weight) -> list[tuple[str, float]]:
        """The ``(file, weight)`` to activate for a request (checked: a listed file, a weight in [-2, 2])."""
        if name in (None, "", NO_LORA):
            return []
        if self.lora_dir is None:
            raise InputError("this demo offers no LoRAs")
        path, weight = check_lora(self.lora_dir, name, weight)
        return [(str(path), weight)]

    def _video(self, task, image, prompt, negative_prompt, num_frames, height, width, num_inference_steps,
               guidance_scale, seed, cache, progress, lora=NO_LORA, lora_weight=1.0) -> VideoResult:
        pipe = self.video_pipeline(task)
        prompt = self.limits.check_prompt(prompt)
        negative_prompt = self.limits.check_prompt(negative_prompt, "negative prompt", required=False) or None
        values = self.limits.check_video(num_frames=num_frames, height=height, width=width,
                                         num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                                         seed=seed)
        if cache not in cache_choices():
            raise InputError(f"unknown cache policy {cache!r}; choose one of {cache_choices()}")
        seed = values.pop("seed")
        loras = self._lora_specs(lora, lora_weight)
        try:
            pipe.resolve(prompt=prompt, **values)  # the model's own rules, before taking the lock
        except (ValueError, TypeError) as exc:
            raise InputError(str(exc)) from None
        steps = values["num_inference_steps"]
        kwargs: dict[str, Any] = {}
        if progress is not None:
            def on_step_end(_pipe, index, _timestep, callback_kwargs):
                progress(index + 1, steps)
                return callback_kwargs

            kwargs["callback_on_step_end"] = on_step_end
        with self._video_lock:
            self._use_cache(task, cache)
            try:
                use_loras(pipe, loras)  # hot swap on the loaded model; loaded files stay for later requests
            except (ValueError, TypeError, FileNotFoundError) as exc:
                raise InputError(f"LoRA {lora!r} cannot be used: {exc}") from None
            args = (image, prompt) if image is not None else (prompt,)
            output = pipe(*args, negative_prompt=negative_prompt, seed=seed, **values, **kwargs)
            audit = pipe.last_audit
        path = self._keep(output, task)
        key = (task, values["num_frames"], values["height"], values["width"], steps, values["guidance_scale"],
               tuple(loras))
        image_text = ""
        if image is not None:
            fitted = output.settings.get("image_size") or [values["width"], values["height"]]
            image_text = (f"reference image {image.size[0]}x{image.size[1]} {image.mode}, centre-cropped and "
                          f"resized to {fitted[0]}x{fitted[1]}")
        return VideoResult(path, self._describe(output, key, cache), audit_summary(audit), image_text)

    def _use_cache(self, task: str, spec: str) -> None:
        """Make ``spec`` the step cache of ``task``'s pipeline; a pipeline sharing its transformer drops its own."""
        pipe = self.video_pipeline(task)
        for other_task, other_spec in list(self._cache_specs.items()):
            other = self.video_pipeline(other_task)
            if other is not pipe and set(map(id, other.transformers)) & set(map(id, pipe.transformers)):
                other.disable_step_cache()
                del self._cache_specs[other_task]
        if self._cache_specs.get(task, "off") == spec and (spec == "off") == (pipe.step_cache is None):
            return
        pipe.disable_step_cache()
        self._cache_specs.pop(task, None)
        try:
            pipe.enable_step_cache(spec)
        except (ValueError, ImportError) as exc:
            raise InputError(f"cache policy {spec!r} cannot run on this model: {exc}") from None
        self._cache_specs[task] = spec

    def _keep(self, output, task: str) -> Path:
        """Write the clip as H.264 MP4 in the output folder; delete the oldest beyond ``NUM_KEPT_CLIPS``."""
        path = output.save(self.output_dir / f"{task}-{uuid.uuid4().hex[:12]}.mp4")
        self._clips.append(path)
        while len(self._clips) > NUM_KEPT_CLIPS:
            self._clips.popleft().unlink(missing_ok=True)
        return path

    def _describe(self, output, key: tuple, cache: str) -> str:
        """Seconds, steps, what the cache reused, and the speedup against the last uncached run of ``key``.

        ``key`` holds the settings that decide the cost (task, frames, size, steps, guidance); prompt and seed do
        not change the work done, so an uncached run with another prompt is a fair baseline.
        """
        stats = output.stats
        frames = output.frames
        lines = [f"{stats.seconds:.2f} s for {frames.shape[0]} frames at {frames.shape[2]}x{frames.shape[1]}, "
                 f"{stats.num_inference_steps} steps, {stats.transformer_calls} transformer calls, "
                 f"{stats.block_evaluations} block evaluations"]
        report = stats.cache
        if cache == "off" or report is None:
            self._uncached[key] = _Uncached(stats.seconds, stats.block_evaluations)
            lines.append("step cache off: every step computed (this run is the baseline for its settings)")
            return "\n".join(lines)
        policy = report.get("policy", cache)
        if report.get("disabled_reason"):
            lines.append(f"step cache {policy}: stood aside ({report['disabled_reason']})")
        elif "num_reused" in report:
            total = report["num_reused"] + report.get("num_computed", 0)
            lines.append(f"step cache {policy}: {report['num_reused']} of {total} transformer calls reused")
        else:
            lines.append(f"step cache {policy}: reuse counted in block evaluations (the baseline reports no steps)")
        if report.get("calibration"):
            lines.append(f"step cache {policy}: {report['calibration']}")
        base = self._uncached.get(key)
        if base is None:
            lines.append("speedup: no uncached run of these settings yet (run once with cache off to compare)")
        else:
            blocks = f", {stats.block_evaluations} of {base.block_evaluations} block evaluations"
            lines.append(f"speedup {base.seconds / max(stats.seconds, 1e-9):.2f}x against the last uncached run "
                         f"of these settings ({base.seconds:.2f} s{blocks})")
        return "\n".join(lines)

    # ------------------------------------------------------------------------------------------------ LLM

    def generate_text(self, prompt: str, max_new_tokens, temperature) -> TextResult:
        """Complete ``prompt`` with the LLM through the async front (concurrent sessions share engine steps); the
        stats line gives TTFT and decode tokens/s.

        Raises:
            InputError: no LLM, an input outside the limits, or a prompt the engine refuses.
        """
        if self.llm is None:
            raise InputError("this demo has no LLM")
        prompt = self.limits.check_prompt(prompt)
        tokens, temperature = self.limits.check_text_request(max_new_tokens=max_new_tokens, temperature=temperature)
        out = self._llm.complete(prompt, tokens, temperature)
        return TextResult(out.text, out.stats_text)

    def close(self) -> None:
        """Stop the LLM's engine thread (when it was started); idempotent."""
        if self._llm is not None:
            self._llm.close()


def audit_summary(report) -> str:
    """The fast-path audit of a call as text, or why it is empty."""
    if report is None or not report.num_calls:
        return ("fast-path audit: no registry kernel ran in this call (start the demo with --fused-kernels to swap "
                "in the fused kernels)")
    return report.summary()
