"""Reference images uploaded with ``POST /v1/videos`` (``input_reference``): checked to be an image, stored
re-encoded as PNG under a name the server chose, inside the data folder.

The upload's own file name is never used, so nothing a client sends can name a path; the bytes are decoded by
Pillow (``verify`` then a full ``load``), so a file that only claims to be an image is refused.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

from metainfer_gen.serve.errors import bad_request


def decode_image(data: bytes, limits):
    """The uploaded image as an RGB ``PIL.Image``.

    Args:
        data: the file's bytes. limits: has ``check_image(image)`` (pixel bound; raises ValueError).
    Raises:
        APIError: 400 (``param`` "input_reference") for empty data, bytes Pillow cannot decode, or too many pixels.
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise bad_request("input_reference is empty: upload an image file", "input_reference")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            probe.verify()  # reads the structure without decoding: cheap, before the pixel bound
        with Image.open(io.BytesIO(data)) as image:
            too_large = _pixel_error(image, limits)
            if too_large is None:
                image.load()
                return image.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError) as exc:
        raise bad_request("input_reference is not a whole image Pillow can read (not an image, truncated, or "
                          "too large to decode); upload a PNG or JPEG", "input_reference") from None
    raise bad_request(f"input_reference: {too_large}", "input_reference")


def _pixel_error(image, limits) -> str | None:
    try:
        limits.check_image(image)
    except ValueError as exc:
        return str(exc)
    return None


def store_image(data: bytes, path: Path, limits) -> Path:
    """Decode ``data`` (see :func:`decode_image`) and write it as PNG at ``path`` atomically (temporary + rename)."""
    image = decode_image(data, limits)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".png", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            image.save(out, format="PNG")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
