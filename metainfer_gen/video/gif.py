"""GIF writing that keeps every frame and the clip's length: per-frame delays rounded on the running total.

Pillow's GIF writer (what imageio uses) merges consecutive identical frames into one with the summed delay, so a
still clip of 48 frames reads back as 1, and it stores 1/fps truncated to centiseconds (the GIF unit), so 24 fps
plays at 25. Here each frame is quantised by Pillow (adaptive palette per frame, as Pillow does) and written
through Pillow's GIF block encoders (``GifImagePlugin.getheader`` / ``getdata``) one by one, none merged.
"""

from __future__ import annotations

import math
import os

import numpy as np

MAX_DELAY_CS = 65535  # a GIF delay is an unsigned 16-bit count of centiseconds


def gif_delays(num_frames: int, fps: float) -> list[int]:
    """Centiseconds each frame is shown: frame ``i`` starts at ``round(100 * i / fps)`` cs.

    1/fps is rarely a whole number of centiseconds (24 fps: 4.17 cs), so the delays vary by one (24 fps: 4, 4, 5,
    4, 4, 4, ...) and every frame starts within half a centisecond of its exact time: the frame count is kept and
    the total is ``num_frames / fps`` seconds to within half a centisecond. Above 100 fps some delays are 0;
    browsers show delays under 2 cs as 10 cs, so a GIF above 50 fps plays slower than asked in them.

    Raises:
        ValueError: a delay that does not fit the GIF field (fps below 100 / 65535, about 0.0015).
    """
    starts = [math.floor(100.0 * i / fps + 0.5) for i in range(num_frames + 1)]
    delays = [end - start for start, end in zip(starts, starts[1:])]
    if delays and max(delays) > MAX_DELAY_CS:
        raise ValueError(f"fps={fps} is too low for GIF: a frame is shown at most {MAX_DELAY_CS / 100} s "
                         f"(fps >= {100 / MAX_DELAY_CS:.4f}); use .mp4 or a higher fps")
    return delays


def write_gif(frames: np.ndarray, path: str | os.PathLike, delays: list[int]) -> None:
    """Write uint8 frames (F, H, W, 3) as a looping GIF at ``path``, frame ``i`` shown ``delays[i]`` centiseconds
    (from :func:`gif_delays`).

    The first frame's palette is the global colour table; every later frame carries its own (local) table.
    Frames with at most 256 colours are stored exactly.

    Raises:
        ValueError: no frames, or ``delays`` does not hold one whole number in 0..65535 per frame.
    """
    from PIL import GifImagePlugin, Image

    if len(frames) == 0:
        raise ValueError("a GIF needs at least one frame; got 0")
    if len(delays) != len(frames) or any(not isinstance(d, int) or not 0 <= d <= MAX_DELAY_CS for d in delays):
        raise ValueError(f"delays must be one integer in 0..{MAX_DELAY_CS} centiseconds per frame ({len(frames)}); "
                         "make them with gif_delays(num_frames, fps)")
    with open(path, "wb") as out:
        for index, (frame, delay) in enumerate(zip(frames, delays)):
            image = Image.fromarray(frame).convert("P", palette=Image.Palette.ADAPTIVE)
            if index == 0:
                header, _ = GifImagePlugin.getheader(image, info={"loop": 0, "duration": 10 * delay})
                out.write(b"".join(header))
            # Pillow takes milliseconds and stores int(ms / 10) centiseconds: whole centiseconds pass exactly.
            blocks = GifImagePlugin.getdata(image, duration=10 * delay, include_color_table=index > 0)
            out.write(b"".join(blocks))
        out.write(b";")  # trailer
