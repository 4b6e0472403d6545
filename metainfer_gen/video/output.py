"""What a video pipeline call returns: the frames, what the call cost, and a way to save them."""

from __future__ import annotations

import os
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from metainfer_gen.video.export import save_video


@dataclass(slots=True)
class GenerationStats:
    """Cost of one pipeline call.

    Attributes:
        seconds: wall time of the whole call (text encoding, denoising, VAE decode), in seconds.
        num_inference_steps: scheduler steps asked for.
        transformer_calls: forward passes of the denoising transformer(s) actually run (CFG doubles them).
        peak_memory_mb: on CUDA, peak allocated device memory during the call; on CPU, the process's peak
            resident set size so far (the OS reports no per-call peak), in MiB.
        device: the device the transformer ran on.
        block_evaluations: transformer blocks actually run, summed over calls (a cached step skips most).
        cache: what the step-cache policy did (``StepCacheStats.to_dict()`` for ours: per step and branch,
            computed or reused, signal, budget); None when no cache is enabled.
    """

    seconds: float = 0.0
    num_inference_steps: int = 0
    transformer_calls: int = 0
    peak_memory_mb: float = 0.0
    device: str = "cpu"
    block_evaluations: int = 0
    cache: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        """One readable line for ``print(out.stats)`` (``repr`` keeps every field, the cache's step records too)."""
        text = (f"{self.seconds:.2f} s, {self.num_inference_steps} steps, {self.transformer_calls} transformer calls, "
                f"{self.block_evaluations} block evaluations, peak {self.peak_memory_mb:.0f} MiB on {self.device}")
        cache = self.cache or {}
        if cache:
            text += f"; cache {cache.get('policy', '?')}"
            if "num_reused" in cache:
                text += f": {cache['num_reused']} of {cache['num_reused'] + cache.get('num_computed', 0)} calls reused"
            if cache.get("disabled_reason"):
                text += f", off for this call: {cache['disabled_reason']}"
        return text


@dataclass(slots=True)
class VideoOutput:
    """One generated clip.

    Attributes:
        frames: uint8 array (num_frames, height, width, 3), RGB.
        stats: :class:`GenerationStats` of the call that made it.
        settings: the call's arguments as used (prompt, seed, sizes, steps, guidance...), JSON-serialisable.
        fps: default frames per second for :meth:`save`.
    """

    frames: np.ndarray
    stats: GenerationStats
    settings: dict[str, Any]
    fps: float = 8.0

    def save(self, path: str | os.PathLike, fps: float | None = None) -> Path:
        """Write the clip: ``.mp4`` (H.264 yuv420p, faststart), ``.gif``, or no suffix for a PNG folder."""
        return save_video(self.frames, path, fps=self.fps if fps is None else fps)


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


@contextmanager
def measure(models: list, device: str) -> Iterator[GenerationStats]:
    """Count forward calls of ``models`` and time the block; fills the yielded stats on exit."""
    import torch

    stats = GenerationStats(device=device)
    calls = [0]

    def count(*_args, **_kwargs):
        calls[0] += 1

    handles = [m.register_forward_pre_hook(count) for m in models if m is not None]
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()
        stats.seconds = time.perf_counter() - start
        stats.transformer_calls = calls[0]
        stats.peak_memory_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else _peak_rss_mb()


def to_uint8_frames(video: Any) -> np.ndarray:
    """diffusers ``output_type="np"`` video (F, H, W, 3) float in [0, 1] -> uint8 (F, H, W, 3)."""
    array = np.asarray(video, dtype=np.float32)
    return (np.clip(array, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


@dataclass(slots=True)
class FramesOutput:
    """What a video pipeline call with diffusers' ``output_type`` returns: diffusers' layout, our stats.

    Attributes:
        frames: one row per video, in diffusers' layout for the ``output_type`` asked: ``"np"`` float32 array
            (videos, num_frames, height, width, 3) in [0, 1]; ``"pt"`` float tensor (videos, num_frames, 3, height,
            width) in [0, 1]; ``"pil"`` a list (per video) of lists of ``PIL.Image``; ``"latent"`` the denoised
            latents (videos, channels, latent frames, latent height, latent width). So ``out.frames[0]`` is the
            first video, as ``diffusers.utils.export_to_video`` expects it.
        stats: :class:`GenerationStats` per video (videos rendered in one batched call share one).
        settings: the arguments each video was rendered with (its own ``seed``), one dict per video.
        output_type: the ``output_type`` asked for.
    """

    frames: Any
    stats: list[GenerationStats]
    settings: list[dict[str, Any]]
    output_type: str = "np"
