"""The signal-to-error mapping of the step cache, measured from one uncached run and stored beside the model.

MagCache (Ma et al. 2025, "MagCache: Fast Video Generation with Magnitude-Aware Cache") observed that how much
the transformer residual changes from one step to the next follows a curve over the schedule that is nearly the
same for every prompt, so it can be measured once per model. We store, per transformer and per position in the
schedule (``progress`` = step / (steps - 1), 0 to 1), the ratio between that change and the cheap live signal
(``StepCacheConfig.signal``): the live signal then scales the curve, so the decision stays driven by the state
of the generation at hand. TeaCache fits a polynomial for the same purpose by hand, per model; here it is one
command: ``metainfer-gen calibrate --model DIR`` (or :func:`calibrate`).

The file, ``step_cache_calibration.json`` beside ``model_index.json`` (or any path), is plain JSON::

    {"format": 1, "signal": "input", "num_inference_steps": 50, "num_runs": 2,
     "models": {"transformer": {"class": "WanTransformer3DModel",
                                "progress": [...], "reuse_ratio": [...], "extrapolation_ratio": [... or null]}}}
"""

from __future__ import annotations

import json
import math
import sys
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from metainfer_gen.video.cache.signals import SIGNALS

FILE_NAME = "step_cache_calibration.json"
FORMAT = 1


@dataclass(frozen=True)
class Curve:
    """Ratios of one transformer over the schedule. ``progress`` increases; ``extrapolation_ratio`` may hold None."""

    model_class: str
    progress: tuple[float, ...]
    reuse_ratio: tuple[float, ...]
    extrapolation_ratio: tuple[float | None, ...]

    def __post_init__(self) -> None:
        if not self.progress or not len(self.progress) == len(self.reuse_ratio) == len(self.extrapolation_ratio):
            raise ValueError("a calibration curve needs equally long, non-empty progress and ratio lists")
        if any(b <= a for a, b in zip(self.progress, self.progress[1:])):
            raise ValueError("calibration progress must increase strictly")
        ratios = [*self.reuse_ratio, *(r for r in self.extrapolation_ratio if r is not None)]
        if any(not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0 for r in ratios):
            raise ValueError("calibration ratios must be finite numbers >= 0")

    def at(self, progress: float) -> tuple[float, float | None]:
        """(reuse ratio, extrapolation ratio or None), linearly interpolated at ``progress`` (clamped to the ends)."""
        points = self.progress
        index = bisect_left(points, progress)
        if index == 0 or index == len(points):
            index = min(index, len(points) - 1)
            return self.reuse_ratio[index], self.extrapolation_ratio[index]
        weight = (progress - points[index - 1]) / (points[index] - points[index - 1])

        def mix(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a + (b - a) * weight

        return (mix(self.reuse_ratio[index - 1], self.reuse_ratio[index]),
                mix(self.extrapolation_ratio[index - 1], self.extrapolation_ratio[index]))


@dataclass(frozen=True)
class Calibration:
    """A loaded calibration: the signal it was measured with, and one :class:`Curve` per transformer attribute.

    Attributes:
        source: where it was read from (a path), for the stats; "" when made in memory.
    """

    signal: str
    num_inference_steps: int
    num_runs: int
    curves: dict[str, Curve]
    source: str = field(default="", compare=False)

    def ratios_at(self, model: str, progress: float) -> tuple[float, float | None] | None:
        """Ratios for transformer attribute ``model`` (``"transformer"``, ``"transformer_2"``) at ``progress``;
        None when this calibration has no curve for that model."""
        curve = self.curves.get(model)
        return None if curve is None else curve.at(progress)

    def matches(self, models: dict[str, Any]) -> str | None:
        """None when every ``{attribute: transformer}`` has a curve of its class; else why not."""
        for name, model in models.items():
            curve = self.curves.get(name)
            if curve is None:
                return f"no curve for {name}"
            if curve.model_class != type(model).__name__:
                return f"{name} is a {type(model).__name__}, the curve was measured on a {curve.model_class}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "signal": self.signal, "num_inference_steps": self.num_inference_steps,
                "num_runs": self.num_runs,
                "models": {name: {"class": c.model_class, "progress": list(c.progress),
                                  "reuse_ratio": list(c.reuse_ratio),
                                  "extrapolation_ratio": list(c.extrapolation_ratio)}
                           for name, c in self.curves.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "") -> "Calibration":
        """Raises ValueError on another format version or a malformed entry."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a step-cache calibration of format {FORMAT}: {source or data!r:.200}")
        if data.get("signal") not in SIGNALS:
            raise ValueError(f"calibration signal must be one of {SIGNALS}; got {data.get('signal')!r}")
        try:
            curves = {name: Curve(entry["class"], tuple(entry["progress"]), tuple(entry["reuse_ratio"]),
                                  tuple(entry["extrapolation_ratio"]))
                      for name, entry in data["models"].items()}
            return cls(data["signal"], int(data["num_inference_steps"]), int(data["num_runs"]), curves, source)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed step-cache calibration {source}: {exc!r}") from None

    def save(self, path: str | Path) -> Path:
        """Write the JSON file (a folder means ``FOLDER/step_cache_calibration.json``); returns the file's path."""
        path = Path(path)
        if path.is_dir():
            path = path / FILE_NAME
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path


def load(path: str | Path) -> Calibration:
    """Read a calibration file (or ``FOLDER/step_cache_calibration.json``).

    Raises:
        FileNotFoundError: no such file. ValueError: not a calibration of this format.
    """
    path = Path(path)
    if path.is_dir():
        path = path / FILE_NAME
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    return Calibration.from_dict(data, source=str(path))


def beside_model(pipe) -> Path | None:
    """``step_cache_calibration.json`` in the folder a diffusers pipeline was loaded from (None when unknown)."""
    folder = getattr(getattr(pipe, "config", None), "_name_or_path", None) or getattr(pipe, "name_or_path", None)
    if not folder or not Path(folder).is_dir():
        return None
    return Path(folder) / FILE_NAME


def fit(stats: Iterable, signal: str, model_classes: dict[str, str]) -> Calibration:
    """A calibration from the stats (:class:`~metainfer_gen.video.cache.stats.StepCacheStats`) of uncached runs
    made with the step cache in recording mode (see :func:`calibrate`): per transformer and step, the mean over
    runs and CFG branches of ``change / signal`` (and of ``extrapolation_error / signal``).
    ``model_classes``: ``{attribute: class name}`` of the transformers, stored to refuse another model later.

    Raises:
        ValueError: no stats, or no computed step with a signal and a measured change.
    """
    stats = list(stats)
    samples: dict[str, dict[int, list[tuple[float, float | None]]]] = {}
    steps = None
    for run in stats:
        steps = run.num_inference_steps or steps
        for record in run.steps:
            if record.computed and record.signal and record.change is not None and record.signal > 1e-12:
                extra = None if record.extrapolation_error is None else record.extrapolation_error / record.signal
                samples.setdefault(record.model, {}).setdefault(record.step, []).append(
                    (record.change / record.signal, extra))
    if not samples or not steps or steps < 2:
        raise ValueError("no computed step with a signal and a measured change: calibrate with at least 3 steps")
    curves = {}
    for model, by_step in samples.items():
        order = sorted(by_step)
        reuse = tuple(sum(r for r, _ in by_step[s]) / len(by_step[s]) for s in order)
        extra = tuple(None if any(e is None for _, e in by_step[s]) else sum(e for _, e in by_step[s]) / len(by_step[s])
                      for s in order)
        curves[model] = Curve(model_classes.get(model, ""), tuple(s / (steps - 1) for s in order), reuse, extra)
    return Calibration(signal, steps, len(stats), curves)
