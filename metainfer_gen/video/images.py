"""Reference images for image-to-video: open any mode and size, fit to the model's grid."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

_MAX_16_BIT = 65535


def load_image(image: Any):
    """A ``PIL.Image`` in RGB from a path, a PIL image (any mode: RGBA, L, P, CMYK, I;16, I, F...) or a uint8 array.

    Transparent pixels are composited on white, so an RGBA logo keeps its look. High-bit-depth grayscale is
    scaled to 8 bits (see :func:`to_8_bit`), not clipped: a 16-bit PNG keeps its brightness.

    Raises:
        FileNotFoundError: a path that does not exist. ValueError: an unreadable file, an array of wrong shape, or
            a float image with NaN or infinite pixels. TypeError: anything else.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (str, os.PathLike)):
        if not os.path.exists(image):
            raise FileNotFoundError(f"image file {image} does not exist")
        try:
            with Image.open(image) as opened:
                image = opened.copy()
        except UnidentifiedImageError as exc:
            raise ValueError(f"{image} is not an image file PIL can read") from exc
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise ValueError(f"image arrays must be uint8 (H, W), (H, W, 1|3|4); got {image.dtype} {image.shape}")
        image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    elif not isinstance(image, Image.Image):
        raise TypeError(f"image must be a path, PIL.Image or uint8 numpy array; got {type(image).__name__}")
    if image.mode.startswith(("I", "F")):
        image = to_8_bit(image)
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def to_8_bit(image):
    """A 16-bit (``I;16``, ``I;16B``...), 32-bit integer (``I``) or float (``F``) grayscale image as mode ``L``.

    PIL's own conversion clips every value above 255 to white. Here the values are scaled by what they hold, so
    nothing is clipped:

    - ``I;16*``: 0..65535 -> 0..255 (divided by 257, rounded).
    - ``I``: the same when every value lies in 0..65535 (PIL opens some 16-bit PNGs and TIFFs as ``I``); else its
      own range, from ``min(0, minimum)`` (black) to its maximum (white).
    - ``F``: 0..1 -> 0..255 when every value lies in [0, 1]; else its own range as for ``I``.
    A constant image whose range is empty (all equal, negative) becomes black.

    Raises:
        ValueError: a float image with NaN or infinite pixels (no brightness to scale them to).
    """
    from PIL import Image

    values = np.asarray(image, dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError(f"the {image.mode} image has NaN or infinite pixels; replace them (e.g. numpy.nan_to_num) "
                         "before passing it")
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if image.mode.startswith("I;16") or (image.mode == "I" and low >= 0 and high <= _MAX_16_BIT):
        black, white = 0.0, float(_MAX_16_BIT)
    elif image.mode == "F" and low >= 0 and high <= 1:
        black, white = 0.0, 1.0
    else:
        black, white = min(0.0, low), high
    span = white - black
    scaled = (values - black) * (255.0 / span) if span > 0 else np.zeros_like(values)
    return Image.fromarray(np.clip(np.round(scaled), 0, 255).astype(np.uint8))  # mode L


def fit_image(image, height: int, width: int):
    """Centre-crop to the target aspect ratio, then resize (Lanczos) to (width, height); never distorts."""
    from PIL import Image

    src_w, src_h = image.size
    scale = max(width / src_w, height / src_h)
    crop_w, crop_h = round(width / scale), round(height / scale)
    left, top = (src_w - crop_w) // 2, (src_h - crop_h) // 2
    return image.crop((left, top, left + crop_w, top + crop_h)).resize((width, height), Image.LANCZOS)
