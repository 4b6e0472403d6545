"""argparse ``type=`` checks shared by the subcommands: a bad value is refused by the parser, before any work."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1. Raises argparse.ArgumentTypeError otherwise (the parser prints it as a usage error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0. Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0. Raises argparse.ArgumentTypeError otherwise."""
    import math

    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text}")
    return value


def guidance(text: str) -> float:
    """A guidance scale: a finite number >= 0 (the video rules' own check, before the model loads).

    Raises argparse.ArgumentTypeError otherwise."""
    import math

    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (1 disables guidance); got {text}")
    return value


def port(text: str) -> int:
    """A TCP port in [0, 65535] (0: any free one). Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535]; got {value}")
    return value


def finite_fps(text: str) -> float:
    """Frames per second: a finite number > 0, checked before anything renders (the exporter's own rule).

    Raises argparse.ArgumentTypeError otherwise."""
    from metainfer_gen.video.export import check_fps

    try:
        return check_fps(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
