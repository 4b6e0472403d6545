"""A second, independent reading of a demo clip's colour and direction, beside the project's reader.

The project's reader (``demo_models.video.evaluate.read_clip``) separates the object from the border's median
colour, names the colour nearest in RGB to the mean of the object's pixels and the direction from the centroid's
path. This one shares none of that: the object is what is bright (max channel above :data:`BRIGHT`; the demo's
backgrounds stay below 0.22, its colours reach 0.85 and more), the colour is the nearest in hue (on the colour
circle) to the median hue of those pixels, and the direction is the shift that best aligns the first frames'
brightness with the last frames' (phase correlation through the FFT), read off its larger axis. A clip counts for
a prompt when both readings match it.
"""

from __future__ import annotations

import colorsys

import numpy as np

BRIGHT = 0.5  # max RGB channel of an object pixel
MIN_SHIFT = 0.05  # of the frame: a smaller shift reads as no motion


def _hue(rgb) -> float:
    return colorsys.rgb_to_hsv(*rgb)[0]


def read_colour(frames: np.ndarray, colours: dict[str, tuple[float, float, float]]) -> str | None:
    """The prompted colour nearest in hue to the median hue of the bright pixels of a uint8 clip (F, H, W, 3)."""
    x = frames.astype(np.float32) / 255.0
    bright = x.max(axis=-1) > BRIGHT
    if bright.sum() < 4:
        return None
    pixels = x[bright]
    hues = np.array([_hue(p) for p in pixels[:: max(1, len(pixels) // 512)]])
    angle = np.angle(np.mean(np.exp(2j * np.pi * hues)))  # circular median stand-in: the mean direction
    hue = (angle / (2 * np.pi)) % 1.0

    def distance(name: str) -> float:
        d = abs(_hue(colours[name]) - hue)
        return min(d, 1.0 - d)
    return min(colours, key=distance)


def read_direction(frames: np.ndarray, directions: dict[str, tuple[float, float]]) -> str | None:
    """The direction of the shift aligning the first quarter's brightness with the last quarter's (phase
    correlation), or None when the shift is under :data:`MIN_SHIFT` of the frame or there is nothing bright."""
    x = frames.astype(np.float32).max(axis=-1) / 255.0
    x = np.where(x > BRIGHT, x, 0.0)
    quarter = max(1, len(x) // 4)
    first, last = x[:quarter].mean(axis=0), x[-quarter:].mean(axis=0)
    if first.sum() == 0 or last.sum() == 0:
        return None
    spectrum = np.fft.fft2(last) * np.conj(np.fft.fft2(first))
    correlation = np.fft.ifft2(spectrum / np.maximum(np.abs(spectrum), 1e-9)).real
    dy, dx = np.unravel_index(int(np.argmax(correlation)), correlation.shape)
    height, width = correlation.shape
    dy, dx = (dy - height if dy > height // 2 else dy), (dx - width if dx > width // 2 else dx)
    if max(abs(dx) / width, abs(dy) / height) < MIN_SHIFT:
        return None
    return max(directions, key=lambda name: directions[name][0] * dx + directions[name][1] * dy)


def follows(frames: np.ndarray, colour: str, direction: str) -> bool:
    """True when both readings of ``frames`` are the prompt's ``colour`` and ``direction``."""
    from demo_models.video.data import COLOURS, DIRECTIONS

    return read_colour(frames, COLOURS) == colour and read_direction(frames, DIRECTIONS) == direction
