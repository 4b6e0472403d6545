"""H.264 MP4 (yuv420p, CRF 18, moov atom first): in process with PyAV when ``av`` imports, else an ffmpeg subprocess.

The in-process writer converts RGB to yuv420p here, in integer numpy arithmetic, and hands libx264 the planes: no
swscale context runs, and any strides (channels-first views) are read through numpy. The same frames give the same
bytes on every call of one process (other clips in between, two threads). The PyAV writer of 929e11a did not: its
P/B frames changed from call to call with contiguous frames too, and the cause is x264's AVX-512 code (see
:func:`x264_params`), not the conversion.

The subprocess path (imageio-ffmpeg, ``pip install metainfer-gen`` without the ``mp4`` extra) costs a fixed ~0.1-0.2 s
per clip to start ffmpeg, and again to read the clip back for :func:`count_mp4_frames`.
"""

from __future__ import annotations

import errno
import functools
import os
from fractions import Fraction
from typing import Any

import numpy as np

MP4_CRF = 18  # x264's constant-rate factor: visually near-lossless at the sizes this package renders
# x264 frame threads, fixed rather than "auto" (1.5 x cores): x264 is deterministic for a given thread count, so a
# fixed count also gives the same bytes on machines with different core counts.
MP4_THREADS = 4

# BT.601 limited range (what ffmpeg's rgb24 -> yuv420p conversion uses for an untagged clip), in 16-bit fixed
# point: Y = 16 + 219/255 (0.299 R + 0.587 G + 0.114 B), Cb/Cr = 128 + 224/255 (B - Y', R - Y') / (2 - 2 Kb|Kr).
# Each row sums to its scale exactly (56284 = 219/255 * 2**16; chroma rows to 0), so grey stays grey.
_Y_COEFFS = (16829, 33039, 6416)
_CB_COEFFS = (-9714, -19071, 28785)
_CR_COEFFS = (28785, -24104, -4681)


class ClipWriteError(OSError):
    """A clip was not written whole: libav failed to write it, or it does not read back whole (ffmpeg's
    subprocess writer reports a full disk or a failed close on its log only, so a truncated MP4 would otherwise
    pass for a finished one)."""


def have_pyav() -> bool:
    """Whether ``av`` (PyAV, the ``mp4`` extra) imports, so MP4s are written and checked in process."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def x264_params() -> str:
    """``x264-params`` for the in-process encoder: ``asm=AVX2`` on a CPU with AVX-512, else empty (x264's own choice).

    With x264's AVX-512 routines (in mbtree/lookahead: ``no-mbtree``, ``rc-lookahead=0`` or ``asm=0`` hide it too)
    the P/B frames of one clip change from encode to encode in one process: 14 different files in 20 encodes of a
    17 x 64 x 64 clip (PyAV 18.1, EPYC); ``asm=AVX2``: 1 in 150 encodes of 5 clips. Likely a read of memory left by
    earlier allocations, which a fresh ffmpeg process gets zeroed: the subprocess path never showed it. x264's asm
    is bit-exact to its C code, so capping it changes no encoding decision;
    ``asm`` is forced, not masked, so it is capped only where AVX-512 (hence AVX2, FMA3, BMI2) is known to be
    present: Linux's /proc/cpuinfo.
    """
    from metainfer_gen.platform import cpu_flags

    return "asm=AVX2" if {"avx512f", "avx512bw", "avx2", "fma", "bmi2"} <= cpu_flags() else ""


def rgb_to_yuv420p(frame: np.ndarray) -> np.ndarray:
    """One RGB frame as the planes of yuv420p, BT.601 limited range, stacked as PyAV's ``from_ndarray`` takes them.

    Args:
        frame: uint8 (H, W, 3), H and W even; any strides (it is only read through numpy indexing).
    Returns:
        uint8 (H * 3 // 2, W), C-contiguous: Y (H, W), then Cb and Cr (H/2, W/2 each) flattened into the rows
        below it. Chroma is the mean over each 2x2 block (centred siting), rounded; Y in [16, 235], Cb/Cr in
        [16, 240].
    Raises:
        ValueError: odd height or width (pad first, see ``export._pad_even``).
    """
    height, width = frame.shape[0], frame.shape[1]
    if height % 2 or width % 2:
        raise ValueError(f"yuv420p needs an even height and width; got {height}x{width}")
    rgb = [frame[..., c].astype(np.int32) for c in range(3)]  # (H, W) each
    luma = (_Y_COEFFS[0] * rgb[0] + _Y_COEFFS[1] * rgb[1] + _Y_COEFFS[2] * rgb[2] + (16 << 16) + (1 << 15)) >> 16
    # Sums over 2x2 blocks, (H/2, W/2), at most 1020: the products stay far inside int32.
    quads = [p[0::2, 0::2] + p[1::2, 0::2] + p[0::2, 1::2] + p[1::2, 1::2] for p in rgb]
    out = np.empty((height * 3 // 2, width), np.uint8)
    out[:height] = luma
    chroma = out[height:].reshape(2, -1)  # Cb then Cr, each H/2 * W/2 samples
    for plane, coeffs in zip(chroma, (_CB_COEFFS, _CR_COEFFS)):
        value = (coeffs[0] * quads[0] + coeffs[1] * quads[1] + coeffs[2] * quads[2] + (128 << 18) + (1 << 17)) >> 18
        plane[:] = np.clip(value, 16, 240).reshape(-1)
    return out


def write_mp4(frames: np.ndarray, path: str, fps: float) -> None:
    """Encode uint8 (F, H, W, 3) frames, H and W even, to ``path`` as H.264 yuv420p MP4 at ``fps`` (CRF 18,
    faststart): with PyAV in process when it imports, else with imageio-ffmpeg's subprocess.

    Raises:
        ClipWriteError: libav could not write the file (a full disk, say); its strerror is the errno's text only,
            not libav's message, which names the path (it reaches API clients). The subprocess path reports such
            failures on its log only; the read-back in ``export.check_written`` catches those.
    """
    if not have_pyav():
        _write_mp4_ffmpeg(frames, path, fps)
        return
    import av

    try:
        _encode_pyav(av, frames, path, Fraction(fps).limit_denominator(1001))
    except av.error.OSError as exc:
        code = exc.errno or errno.EIO
        raise ClipWriteError(code, os.strerror(code)) from exc  # strerror only: libav's message names the path


def _encode_pyav(av: Any, frames: np.ndarray, path: str, rate: Fraction) -> None:
    """libx264 encode and mp4 mux of :func:`write_mp4`: fixed pts, time base and thread count; bitexact flags keep
    libav's version strings out of the file, and the mp4 muxer writes no creation time unless given one."""
    options = {"movflags": "+faststart", "fflags": "+bitexact"}
    with av.open(path, mode="w", format="mp4", container_options=options) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        codec = stream.codec_context
        codec.time_base = 1 / rate
        codec.thread_type = "FRAME"  # the ffmpeg command line's choice for x264 (PyAV defaults to slices)
        codec.thread_count = MP4_THREADS
        stream.options = {"crf": str(MP4_CRF), "flags": "+bitexact"}
        if x264_params():
            stream.options = {**stream.options, "x264-params": x264_params()}
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb_to_yuv420p(rgb), format="yuv420p")
            frame.pts, frame.time_base = i, codec.time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush the encoder's delayed frames


def _write_mp4_ffmpeg(frames: np.ndarray, path: str, fps: float) -> None:
    """The subprocess writer: imageio-ffmpeg's ffmpeg binary, rgb24 piped in and converted by its swscale."""
    import imageio.v2 as imageio

    writer = imageio.get_writer(
        path, format="FFMPEG", fps=fps, codec="libx264", pixelformat="yuv420p", macro_block_size=1,
        ffmpeg_params=["-movflags", "+faststart", "-crf", str(MP4_CRF)], ffmpeg_log_level="error",
    )
    with writer:
        for frame in frames:
            writer.append_data(frame)


def count_mp4_frames(path: str | os.PathLike) -> int:
    """Decode the video stream of the MP4 at ``path`` and count its frames (in process with PyAV when it imports).

    Raises:
        whatever the decoder raises on a file that does not decode (``export.check_written`` turns it into a
        ``ClipWriteError``).
    """
    if not have_pyav():
        import imageio.v2 as imageio

        with imageio.get_reader(path, format="FFMPEG") as reader:
            return sum(1 for _ in reader)
    import av

    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))
