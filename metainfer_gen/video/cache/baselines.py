"""The public step caches we compare against, applied through their own APIs (no re-implementation).

* ``fbcache``: diffusers ``FirstBlockCacheConfig(threshold)`` (default 0.05, tuned upstream for trained models).
* ``magcache``: diffusers ``MagCacheConfig``. Its ``mag_ratios`` are model-dependent: the first call with this
  policy runs MagCache's own ``calibrate=True`` mode (nothing skipped) and keeps the ratios it reports; later
  calls use them (interpolated by MagCache to their step count) until the LoRA state changes, which recalibrates.
* ``taylorseer``: diffusers ``TaylorSeerCacheConfig`` on every attention and feed-forward module of every block
  (its default identifiers match nothing on Wan, whose attention is ``attn1``/``attn2``).
* ``dbcache``: cache-dit ``DBCacheConfig`` with ``Fn_compute_blocks=1, Bn_compute_blocks=0`` (its default of 8
  front blocks fails on models with fewer blocks). Optional dependency: ``pip install cache-dit``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from metainfer_gen.video.cache.blocks import find_blocks
from metainfer_gen.video.cache.policy import CachePolicy, DiffusersCachePolicy, denoisers


def _threshold(policy: str, value: float | None, default: float) -> float:
    """``value`` (or ``default`` when None) checked as a baseline's threshold: finite and > 0."""
    if value is None:
        return default
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"the {policy} threshold must be a finite number > 0 (e.g. {policy}={default:g}); got "
                         f"{value:g}")
    return value


def _fbcache(value: float | None) -> CachePolicy:
    from diffusers.hooks import FirstBlockCacheConfig

    threshold = _threshold("fbcache", value, 0.05)
    return DiffusersCachePolicy(f"fbcache={threshold:g}", lambda model, steps: FirstBlockCacheConfig(threshold))


def taylorseer_identifiers(transformer) -> list[str]:
    """Exact-name patterns of the attention and feed-forward modules directly inside each block."""
    import re

    names = []
    for block_name, block in find_blocks(transformer):
        for child_name, child in block.named_children():
            kinds = " ".join(cls.__name__ for cls in type(child).__mro__)
            if "Attention" in kinds or "FeedForward" in kinds:
                names.append(re.escape(f"{block_name}.{child_name}"))
    return names


def _taylorseer(value: float | None) -> CachePolicy:
    from diffusers.hooks import TaylorSeerCacheConfig

    if value is not None and (not math.isfinite(value) or value != int(value) or value < 1):
        raise ValueError(f"the taylorseer interval must be a whole number of steps >= 1 (e.g. taylorseer=5); got "
                         f"{value:g}")
    interval = 5 if value is None else int(value)
    return DiffusersCachePolicy(f"taylorseer={interval}", lambda model, steps: TaylorSeerCacheConfig(
        cache_interval=interval, disable_cache_before_step=3, max_order=1, taylor_factors_dtype=None,
        cache_identifiers=taylorseer_identifiers(model)))


class MagCachePolicy(DiffusersCachePolicy):
    """MagCache that calibrates itself on its first call (see the module docstring)."""

    def __init__(self, threshold: float):
        super().__init__(f"magcache={threshold:g}", self._config, per_steps=True)
        self.threshold = threshold
        self.mag_ratios: list[float] | None = None
        self.calibrated_for: tuple | None = None  # lora_state of the denoisers when the ratios were measured

    def _config(self, model, steps: int | None):
        from diffusers.hooks import MagCacheConfig

        steps = steps or 28
        if self.mag_ratios is None:
            return MagCacheConfig(calibrate=True, num_inference_steps=steps)
        return MagCacheConfig(threshold=self.threshold, num_inference_steps=steps, mag_ratios=self.mag_ratios)

    @contextmanager
    def session(self, pipe, num_inference_steps: int) -> Iterator[dict[str, Any]]:
        from metainfer_gen.video.lora import lora_state

        adapters = tuple(lora_state(model) for _, model in denoisers(pipe))
        if adapters != self.calibrated_for:  # the ratios describe one set of weights: a LoRA change recalibrates
            self.mag_ratios, self.calibrated_for = None, adapters
        calibrating = self.mag_ratios is None
        if calibrating:
            self.applied_steps = None  # apply in calibration mode for this step count
        records = _Capture()
        logger = logging.getLogger("diffusers.hooks.mag_cache")
        level, propagate = logger.level, logger.propagate
        quiet = contextlib.redirect_stdout(io.StringIO()) if calibrating else contextlib.nullcontext()
        if calibrating:  # read the ratios from MagCache's log record; keep its print-out off our stdout
            logger.addHandler(records)
            logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
            logger.propagate = False
        try:
            with quiet, super().session(pipe, num_inference_steps) as report:
                yield report
        finally:
            if calibrating:
                logger.removeHandler(records)
                logger.setLevel(level)
                logger.propagate = propagate
        if calibrating and records.ratios:
            self.mag_ratios = records.ratios[0]
            self.applied_steps = None  # next call: re-apply with the ratios
            report["calibration"] = "this call calibrated mag_ratios (nothing skipped)"


class _Capture(logging.Handler):
    """Keeps the ratio lists MagCache logs at the end of a calibration run (one per cache context)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ratios: list[list[float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Calibration Results:" in message:
            self.ratios.append([float(x) for x in ast.literal_eval(message.split("Results:", 1)[1].strip())])


class DBCachePolicy(CachePolicy):
    """cache-dit DBCache on the whole pipeline (``cache_dit.enable_cache`` / ``disable_cache``)."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.name = f"dbcache={threshold:g}"

    def apply(self, pipe) -> None:
        try:
            import cache_dit
        except ImportError as exc:
            raise ValueError("the dbcache policy needs cache-dit: pip install cache-dit") from exc
        config = cache_dit.DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0,
                                         residual_diff_threshold=self.threshold)
        cache_dit.enable_cache(pipe, cache_config=config)

    def remove(self, pipe) -> None:
        import cache_dit

        cache_dit.disable_cache(pipe)

    @contextmanager
    def session(self, pipe, num_inference_steps: int) -> Iterator[dict[str, Any]]:
        yield {"policy": self.name}


BASELINES: dict[str, Callable[[float | None], CachePolicy]] = {
    "fbcache": _fbcache,
    "magcache": lambda value: MagCachePolicy(_threshold("magcache", value, 0.06)),
    "taylorseer": _taylorseer,
    "dbcache": lambda value: DBCachePolicy(_threshold("dbcache", value, 0.08)),
}
