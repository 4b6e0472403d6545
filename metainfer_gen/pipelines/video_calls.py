"""One call of the video pipelines: seeds, ``num_videos_per_prompt`` (each video its own seed and stats) and
diffusers' ``output_type`` layouts, around the wrapped diffusers call with every accelerator's per-call session."""

from __future__ import annotations

import inspect
import secrets
from contextlib import nullcontext
from typing import Any

from metainfer_gen.pipelines.call_lock import call_lock
from metainfer_gen.video.output import FramesOutput, VideoOutput, measure, to_uint8_frames

# diffusers' output types; None (the default) is ours: uint8 frames and save()
OUTPUT_TYPES = ("np", "pil", "pt", "latent")
# Further diffusers call arguments a model's settings file may fix (the length its transformer was trained to read).
_MODEL_ARGS = ("max_sequence_length",)


def check_call_options(num_videos_per_prompt: Any, output_type: Any, seed: Any, generator: Any) -> None:
    """Refuse bad ``num_videos_per_prompt`` / ``output_type`` / ``seed`` / ``generator`` before any work.

    Raises:
        TypeError / ValueError: naming the argument and what it accepts.
    """
    if isinstance(num_videos_per_prompt, bool) or not isinstance(num_videos_per_prompt, int):
        raise TypeError(f"num_videos_per_prompt must be an int >= 1; got {num_videos_per_prompt!r}")
    if num_videos_per_prompt < 1:
        raise ValueError(f"num_videos_per_prompt must be >= 1; got {num_videos_per_prompt}")
    if output_type is not None and output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {', '.join(map(repr, OUTPUT_TYPES))}, or None for uint8 "
                         f"frames with save(); got {output_type!r}")
    if generator is None and seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int; got {seed!r}")
    if isinstance(generator, list) and num_videos_per_prompt > 1 and len(generator) != num_videos_per_prompt:
        raise ValueError(f"a list of generators needs one per video: {num_videos_per_prompt} for "
                         f"num_videos_per_prompt={num_videos_per_prompt}; got {len(generator)}")


def video_seeds(seed: int | None, generator: Any, num_videos: int) -> list[int]:
    """One seed per video: ``seed, seed + 1, ...``; drawn from ``generator`` when one is given; random (and
    recorded in each video's settings) when neither is."""
    import torch

    if generator is not None:
        return [int(torch.randint(0, 2**62, (1,), generator=generator)) for _ in range(num_videos)]
    if seed is not None:
        return [seed + i for i in range(num_videos)]
    return [secrets.randbelow(2**62) for _ in range(num_videos)]


def _concat(parts: list) -> Any:
    """Join per-call frames (one row per video) along the video axis."""
    first = parts[0]
    if isinstance(first, list):
        return [video for part in parts for video in part]
    if hasattr(first, "dtype") and type(first).__module__.startswith("numpy"):
        import numpy as np

        return np.concatenate(parts, axis=0)
    import torch

    return torch.cat(parts, dim=0)


class VideoCallMixin:
    """Methods of :class:`~metainfer_gen.pipelines.video_base.VideoPipelineBase`."""

    def _run(self, call_kwargs: dict[str, Any], settings: dict[str, Any], seed: int | None, generator=None, *,
             num_videos_per_prompt: int = 1, output_type: str | None = None):
        """Render every video of the call: ``list[VideoOutput]`` (prompt-major, as diffusers orders them) for
        ``output_type=None``, else a :class:`FramesOutput` in diffusers' layout."""
        check_call_options(num_videos_per_prompt, output_type, seed, generator)
        # one call at a time per model, whichever thread calls: keyed by the transformer, which ``from_pipe``
        # shares with its scheduler and step-cache hooks
        with call_lock(getattr(self.diffusers_pipeline, "transformer", None) or self.diffusers_pipeline):
            if num_videos_per_prompt == 1:
                calls = [self._call(dict(call_kwargs), dict(settings), seed, generator, output_type)]
            else:
                generators = generator if isinstance(generator, list) else [None] * num_videos_per_prompt
                seeds = [None] * num_videos_per_prompt if isinstance(generator, list) else \
                    video_seeds(seed, generator, num_videos_per_prompt)
                calls = [self._call(dict(call_kwargs), dict(settings), s, g, output_type)
                         for s, g in zip(seeds, generators)]
        num_prompts = len(call_kwargs["prompt"]) if isinstance(call_kwargs.get("prompt"), list) else 1
        order = [(call, row) for row in range(num_prompts) for call in calls]  # prompt-major
        if output_type is None:
            fps = float(self.settings.get("fps", 8.0))
            return [VideoOutput(to_uint8_frames(call[0][row]), call[1], dict(call[2]), fps=fps)
                    for call, row in order]
        return FramesOutput(_concat([call[0][row:row + 1] for call, row in order]),
                            [call[1] for call, _ in order], [dict(call[2]) for call, _ in order], output_type)

    def _call(self, call_kwargs: dict[str, Any], settings: dict[str, Any], seed: int | None, generator,
              output_type: str | None):
        """One diffusers call: (frames in diffusers' ``output_type`` layout, or float np for ours; stats;
        settings with the seed used)."""
        import torch

        from metainfer_gen.kernels import audit
        from metainfer_gen.video.cache import count_block_evaluations
        from metainfer_gen.video.pieces import time_pieces, with_setup
        from metainfer_gen.video.prompt_cache import get_prompt_cache

        steps = call_kwargs["num_inference_steps"]
        accepted = inspect.signature(self.diffusers_pipeline.__call__).parameters
        for name in _MODEL_ARGS:
            if name in self.settings and name in accepted:
                call_kwargs.setdefault(name, self.settings[name])
        session = self.step_cache.session(self.diffusers_pipeline, steps) if self.step_cache else nullcontext(None)
        with audit() as report:
            parallel, seed = self._parallel_session(call_kwargs, seed, generator)
            if generator is None:
                settings["seed"] = seed  # with several ranks, rank 0's draw when no seed was given: reproducible
            if generator is None and seed is not None:
                generator = torch.Generator(device="cpu").manual_seed(seed)
            with measure(self.transformers, self.device) as stats, torch.inference_mode(), \
                    count_block_evaluations(self.transformers) as blocks, session as cache_report, \
                    parallel as records, self._embed_memo_call(), \
                    time_pieces(self.diffusers_pipeline, self.transformers, self.device) as pieces:
                result = self.diffusers_pipeline(**call_kwargs, generator=generator, output_type=output_type or "np")
        self.last_audit = report
        stats.extra["seconds_by_piece"] = with_setup(pieces, stats.seconds)
        prompt_cache = get_prompt_cache(self.diffusers_pipeline)
        if prompt_cache is not None:
            stats.extra["prompt_cache"] = prompt_cache.to_dict()
        if self.acceleration is not None:
            stats.extra["acceleration"] = self.acceleration.to_dict()
        stats.num_inference_steps = steps
        stats.block_evaluations = blocks.num_evaluations
        stats.cache = cache_report
        self._parallel_stats(stats, records)
        return result.frames, stats, settings
