"""Cache policies a pipeline can run, by name: ours ("auto", "quality", "balanced", "fast") and the public
baselines through their own APIs (diffusers FirstBlockCache, MagCache, TaylorSeer; cache-dit DBCache).

A spec is ``name`` or ``name=value``: the value is our error budget, FirstBlockCache's / MagCache's / DBCache's
threshold, or TaylorSeer's cache interval (the policies themselves: :mod:`.policy`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from metainfer_gen.video.cache.baselines import BASELINES
from metainfer_gen.video.cache.calibration import Calibration, load
from metainfer_gen.video.cache.config import PRESETS, StepCacheConfig
from metainfer_gen.video.cache.policy import CachePolicy, StepCachePolicy

OFF = "off"


def parse_spec(spec: str) -> tuple[str, float | None]:
    """``"fbcache=0.1"`` -> ("fbcache", 0.1); ``"auto"`` -> ("auto", None).

    Raises:
        ValueError: an unknown name or a value that is not a number.
    """
    name, _, text = spec.strip().lower().partition("=")
    if name not in policy_names():
        raise ValueError(f"unknown cache policy {spec!r}; choose one of {policy_names()} (optionally name=value)")
    if not text:
        return name, None
    try:
        return name, float(text)
    except ValueError:
        raise ValueError(f"cache policy value must be a number, as in 'fbcache=0.1'; got {text!r}") from None


def policy_names() -> list[str]:
    """Every name ``make_policy`` accepts."""
    return [OFF, "auto", *PRESETS, *BASELINES]


def make_policy(spec: str | StepCacheConfig | CachePolicy, calibration: Any = None) -> CachePolicy | None:
    """A policy from a spec string, a :class:`StepCacheConfig` or a ready policy; None for ``"off"``.

    ``calibration`` (ours only): a calibration file's path or a loaded
    :class:`~metainfer_gen.video.cache.calibration.Calibration`; its signal replaces the config's.

    Raises:
        ValueError: unknown name, bad value, or a calibration with a baseline. TypeError: another type.
        FileNotFoundError: no such calibration file.
    """
    if calibration is not None and not isinstance(calibration, Calibration):
        calibration = load(calibration)
    if isinstance(spec, CachePolicy):
        policy = spec
    elif isinstance(spec, StepCacheConfig):
        policy = StepCachePolicy(spec, name="custom")
    elif not isinstance(spec, str):
        raise TypeError(f"cache must be a policy name, a StepCacheConfig or a CachePolicy; got {type(spec).__name__}")
    else:
        name, value = parse_spec(spec)
        if name == OFF:
            return None
        if name in BASELINES:
            if calibration is not None:
                raise ValueError(f"a calibration applies to our step cache, not to the {name} baseline")
            return BASELINES[name](value)
        overrides = {} if value is None else {"error_budget": value}
        policy = StepCachePolicy(StepCacheConfig.preset(name, **overrides), name=spec.strip().lower(),
                                 find_calibration=True)
    if calibration is not None:
        if not isinstance(policy, StepCachePolicy):
            raise ValueError(f"a calibration applies to our step cache, not to {policy.name}")
        policy.config = replace(policy.config, signal=calibration.signal, calibration=calibration)
    return policy
