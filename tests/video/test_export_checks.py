"""``metainfer_gen.video.export`` reads every clip back before it takes its final name: a truncated MP4 (what
ffmpeg leaves on a full disk while reporting it on its log only) raises instead of becoming a result."""

from __future__ import annotations

import errno
import os
import subprocess

import numpy as np
import pytest

from metainfer_gen.video.export import ClipWriteError, check_written, save_video


def frames(num_frames: int = 9, size: int = 32) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (num_frames, size, size, 3), dtype=np.uint8)


def test_a_clip_that_does_not_read_back_whole_is_refused(tmp_path):
    whole = save_video(frames(), tmp_path / "whole.mp4", fps=8)
    check_written(whole, 9)  # a whole clip passes
    with pytest.raises(ClipWriteError, match="has 9 of its 10 frames") as missing:
        check_written(whole, 10)
    assert missing.value.errno == errno.EIO
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ClipWriteError, match="is the disk full") as truncated:
        check_written(cut, 9)
    assert str(tmp_path) not in str(truncated.value)  # the message reaches API clients: no server path


def test_a_full_disk_raises_and_leaves_no_file(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with pytest.raises(ClipWriteError):
            save_video(frames(33, 64), folder / "clip.mp4", fps=8)  # random 64 x 64 frames: more than 64 KB
        assert os.listdir(folder) == []  # neither the clip nor its hidden temporary
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
