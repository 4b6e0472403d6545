"""Reference images for image-to-video: open any mode and size, fit to the model's grid."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def load_image(image: Any):
    """A ``PIL.Image`` in RGB from a path, a PIL image (any mode: RGBA, L, P, CMYK...) or a uint8 array.

    Transparent pixels are composited on white, so an RGBA logo keeps its look.

    Raises:
        FileNotFoundError: a path that does not exist. ValueError: an unreadable file or array of wrong shape.
        TypeError: anything else.
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
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def fit_image(image, height: int, width: int):
    """Centre-crop to the target aspect ratio, then resize (Lanczos) to (width, height); never distorts."""
    from PIL import Image

    src_w, src_h = image.size
    scale = max(width / src_w, height / src_h)
    crop_w, crop_h = round(width / scale), round(height / scale)
    left, top = (src_w - crop_w) // 2, (src_h - crop_h) // 2
    return image.crop((left, top, left + crop_w, top + crop_h)).resize((width, height), Image.LANCZOS)
