"""Inspect MP4 files without ffprobe: top-level ISO-BMFF boxes from the bytes, stream facts from the ffmpeg binary."""

from __future__ import annotations

import re
import struct
import subprocess
from pathlib import Path


def mp4_top_level_atoms(data: bytes) -> list[str]:
    """Types of the top-level boxes of an ISO-BMFF file, in file order."""
    atoms, offset = [], 0
    while offset + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[offset:offset + 8])
        if size == 1:  # 64-bit size follows the type
            size = struct.unpack(">Q", data[offset + 8:offset + 16])[0]
        elif size == 0:  # box runs to the end of the file
            size = len(data) - offset
        assert size >= 8, f"corrupt box {kind!r} of size {size} at offset {offset}"
        atoms.append(kind.decode("latin-1"))
        offset += size
    assert offset == len(data), "boxes do not tile the file"
    return atoms


def ffmpeg_stream_info(path: Path) -> dict:
    """Codec, pixel format, size, fps and decoded frame count of the first video stream, from the ffmpeg binary."""
    from imageio_ffmpeg import get_ffmpeg_exe

    # `ffmpeg -i file` alone prints the stream line; decoding to the null muxer also prints the frame count.
    result = subprocess.run(
        [get_ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", str(path), "-map", "0:v:0", "-f", "null", "-"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    stream = re.search(r"Stream #0:0.*?Video: (\w+).*?, (\w+)(?:\(.*?\))?, (\d+)x(\d+).*?, ([\d.]+) fps",
                       result.stderr)
    assert stream is not None, result.stderr
    frames = re.findall(r"frame=\s*(\d+)", result.stderr)
    assert frames, result.stderr
    codec, pix_fmt, width, height, fps = stream.groups()
    return {"codec": codec, "pix_fmt": pix_fmt, "width": int(width), "height": int(height), "fps": float(fps),
            "frames": int(frames[-1])}
