"""Write clips to MP4 (H.264, yuv420p, faststart; :mod:`.mp4`), GIF (:mod:`.gif`) or a folder of PNG frames, atomically.

A clip appears under its final name complete or not at all: every writer writes to a temporary sibling and
renames it into place (``os.replace`` is atomic on one file system), so a crash mid-write never leaves a
truncated file that a resumed batch render would take for a finished one.
"""

from __future__ import annotations

import math
import numbers
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from metainfer_gen.video.mp4 import ClipWriteError

VIDEO_SUFFIXES = (".mp4", ".gif")


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` as the process umask would leave it for a newly created file (``tempfile`` makes 0600/0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def check_output_path(path: str | os.PathLike) -> Path:
    """Check the suffix names a format :func:`save_video` writes, before any rendering work.

    Raises:
        ValueError: a suffix other than .mp4 or .gif (no suffix means a folder of PNG frames).
    """
    path = Path(path)
    if path.suffix and path.suffix.lower() not in VIDEO_SUFFIXES:
        raise ValueError(f"unsupported output {path.name!r}: use .mp4, .gif, or a name without suffix for PNG frames")
    return path


def check_frames(frames: np.ndarray) -> np.ndarray:
    """Validate a clip: uint8 array of shape (F, H, W, 3) with F >= 1.

    Raises:
        TypeError: not a uint8 numpy array. ValueError: wrong rank, channel count or no frames.
    """
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise TypeError(f"frames must be a uint8 numpy array (F, H, W, 3); got {type(frames).__name__} "
                        f"{getattr(frames, 'dtype', '')}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"frames must have shape (F, H, W, 3) with F >= 1; got {frames.shape}")
    return frames


def _pad_even(frames: np.ndarray) -> np.ndarray:
    """yuv420p subsamples chroma 2x2, so H.264 needs even sizes: pad odd ones by repeating the last row/column."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    return frames


def check_fps(fps: Any) -> float:
    """``fps`` as given when it is a finite number > 0 (frames per second).

    Raises:
        ValueError: anything else (nan, inf, 0, negative, a bool or a non-number), naming the value.
    """
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a finite number > 0 (e.g. 8 or 24); got {fps!r}")
    return fps


def save_video(frames: np.ndarray, path: str | os.PathLike, fps: float = 8.0) -> Path:
    """Save a clip; the format follows the suffix.

    Args:
        frames: uint8 (F, H, W, 3).
        path: ``*.mp4`` (H.264 yuv420p with the moov atom first, playable in browsers), ``*.gif`` (loops; keeps
            every frame, identical ones too; delays in whole centiseconds, see ``video.gif.gif_delays``), or a
            path without a suffix, which becomes a folder of ``frame_00000.png``... files.
        fps: frames per second, a finite number > 0.
    Returns:
        The path written.
    Raises:
        ValueError: unknown suffix, fps not a finite number > 0 (or too low for a GIF's delays), or bad frames
            (see :func:`check_frames`); all checked before anything is written.
    """
    import imageio.v2 as imageio

    from metainfer_gen.video.gif import gif_delays, write_gif
    from metainfer_gen.video.mp4 import write_mp4

    frames = check_frames(frames)
    check_fps(fps)
    path = check_output_path(path)
    suffix = path.suffix.lower()
    delays = gif_delays(len(frames), fps) if suffix == ".gif" else None
    path.parent.mkdir(parents=True, exist_ok=True)
    if not suffix:
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        os.chmod(tmp_dir, umask_mode(0o777))
        try:
            for i, frame in enumerate(frames):
                imageio.imwrite(tmp_dir / f"frame_{i:05d}.png", frame)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp_dir, path)
        finally:
            # A failed write must not leave a hidden half-written frame folder behind.
            if tmp_dir.exists():
                shutil.rmtree(tmp_dir)
        return path
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=suffix, dir=path.parent)
    os.fchmod(fd, umask_mode())
    os.close(fd)
    try:
        if suffix == ".mp4":
            write_mp4(_pad_even(frames), tmp_name, fps)
        else:
            write_gif(frames, tmp_name, delays)  # not imageio's: Pillow's writer merges identical frames
        check_written(tmp_name, len(frames))
        durable_replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return path


def check_written(path: str | os.PathLike, num_frames: int) -> None:
    """Decode the clip at ``path`` and count its frames (before it is renamed into place).

    Raises:
        ClipWriteError: it does not decode, or has fewer than ``num_frames`` frames (errno EIO; no path in the
            message: it reaches API clients).
    """
    import errno

    from metainfer_gen.video.mp4 import count_mp4_frames

    try:
        found = count_mp4_frames(path) if Path(path).suffix.lower() == ".mp4" else len(read_video(path))
    except Exception as exc:  # noqa: BLE001 - whatever the decoder raises, the clip is not whole
        raise ClipWriteError(errno.EIO, f"the written clip does not decode ({type(exc).__name__}); is the disk "
                                        "full?") from exc
    if found < num_frames:
        raise ClipWriteError(errno.EIO, f"the written clip has {found} of its {num_frames} frames; is the disk full?")


def durable_replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename the finished file ``src`` onto ``dst`` so that a crash or power cut leaves either the old ``dst`` or
    the whole new one: fsync the file, rename it (atomic within one filesystem, NFS included), fsync the folder."""
    fd = os.open(src, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)
    folder = os.open(os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_video(path: str | os.PathLike) -> np.ndarray:
    """Read a clip written by :func:`save_video` back as uint8 (F, H, W, 3)."""
    import imageio.v2 as imageio

    path = Path(path)
    if path.is_dir():
        return np.stack([imageio.imread(p)[..., :3] for p in sorted(path.glob("frame_*.png"))])
    if path.suffix.lower() == ".gif":
        return np.stack([f[..., :3] for f in imageio.mimread(path)])
    with imageio.get_reader(path, format="FFMPEG") as reader:
        return np.stack([frame for frame in reader])
