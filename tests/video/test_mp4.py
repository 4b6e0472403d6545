"""``metainfer_gen.video.mp4``: the in-process MP4 writer is deterministic, reads any strides, keeps the pictures, and
falls back to the ffmpeg subprocess without PyAV."""

from __future__ import annotations

import hashlib
import sys
import threading

import numpy as np
import pytest

from metainfer_gen.video import mp4
from metainfer_gen.video.export import read_video, save_video
from tests.video.mp4_inspect import ffmpeg_stream_info, mp4_top_level_atoms
from tests.video.test_export import random_frames, smooth_frames

needs_pyav = pytest.mark.skipif(not mp4.have_pyav(), reason="PyAV (the mp4 extra) is not installed")


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bt601_reference(frame: np.ndarray) -> np.ndarray:
    """Float BT.601 limited-range yuv420p (chroma: mean of each 2x2 block), stacked as ``rgb_to_yuv420p`` does."""
    rgb = frame.astype(np.float64)
    y = 16 + 219 / 255 * (rgb @ np.array([0.299, 0.587, 0.114]))
    quad = (rgb[0::2, 0::2] + rgb[1::2, 0::2] + rgb[0::2, 1::2] + rgb[1::2, 1::2]) / 4
    luma_quad = quad @ np.array([0.299, 0.587, 0.114])
    cb = 128 + 224 / 255 * (quad[..., 2] - luma_quad) / 1.772
    cr = 128 + 224 / 255 * (quad[..., 0] - luma_quad) / 1.402
    return np.concatenate([y.reshape(-1), cb.reshape(-1), cr.reshape(-1)]).reshape(-1, frame.shape[1])


@pytest.mark.parametrize("height, width", [(32, 48), (2, 2), (64, 30)])
def test_yuv420p_matches_the_bt601_formula_within_rounding(height, width):
    frame = random_frames(1, height, width, seed=height * width)[0]
    yuv = mp4.rgb_to_yuv420p(frame)

    assert yuv.shape == (height * 3 // 2, width) and yuv.dtype == np.uint8 and yuv.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(yuv.astype(np.float64), bt601_reference(frame), atol=0.51)


def test_yuv420p_ranges_and_grey_are_exact():
    levels = np.array([0, 128, 255], np.uint8)
    grey = np.broadcast_to(levels[:, None, None, None], (3, 2, 2, 3))
    for level, expected_y in zip(grey, (16, 126, 235)):  # 16 + 219 * 128 / 255 = 125.9
        yuv = mp4.rgb_to_yuv420p(level)
        assert (yuv[:2] == expected_y).all() and (yuv[2:] == 128).all()
    primaries = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [255, 255, 255]]], np.uint8)
    yuv = mp4.rgb_to_yuv420p(np.repeat(np.repeat(primaries, 2, 0), 2, 1))
    assert yuv.min() >= 16 and yuv[:4].max() <= 235 and yuv[4:].max() <= 240


def test_yuv420p_refuses_odd_sizes():
    with pytest.raises(ValueError, match="even height and width"):
        mp4.rgb_to_yuv420p(random_frames(1, 3, 4)[0])


def strided_views(frames: np.ndarray) -> list[np.ndarray]:
    """The same pictures (F, H, W, 3) in other layouts: channels first (a pipeline's), Fortran order, and a window
    of a wider RGBA buffer (padded rows and pixels)."""
    channels_first = np.ascontiguousarray(frames.transpose(3, 0, 1, 2)).transpose(1, 2, 3, 0)
    wide = np.zeros(frames.shape[:2] + (frames.shape[2] + 8, 4), np.uint8)
    wide[:, :, :frames.shape[2], :3] = frames
    views = [channels_first, np.asfortranarray(frames), wide[:, :, :frames.shape[2], :3]]
    assert not any(view.flags["C_CONTIGUOUS"] for view in views)
    return views


def test_strided_views_convert_like_their_contiguous_copy():
    frames = random_frames(2, 16, 24, seed=4)
    for view in strided_views(frames):
        np.testing.assert_array_equal(mp4.rgb_to_yuv420p(view[1]), mp4.rgb_to_yuv420p(frames[1]))


@needs_pyav
def test_same_frames_give_the_same_bytes_on_every_call_of_one_process(tmp_path):
    frames = smooth_frames(17, 64, 64, seed=1)
    first = digest(save_video(frames, tmp_path / "clip.mp4", fps=8))
    for i in range(20):
        # Other clips (sizes, lengths, rates) and freed memory in between: the encoder must not carry any of it.
        save_video(random_frames(5, 32, 48, seed=i), tmp_path / "other.mp4", fps=12)
        save_video(smooth_frames(3 + i % 4, 48, 32, seed=i), tmp_path / "another.mp4", fps=24)
        assert digest(save_video(frames, tmp_path / "clip.mp4", fps=8)) == first, f"call {i + 2} differs"


@needs_pyav
def test_two_threads_writing_the_same_frames_write_the_same_bytes(tmp_path):
    frames = smooth_frames(17, 64, 64, seed=2)
    expected = digest(save_video(frames, tmp_path / "serial.mp4", fps=8))
    found: dict[int, list[str]] = {}

    def work(k: int) -> None:
        found[k] = [digest(save_video(frames, tmp_path / f"t{k}_{j}.mp4", fps=8)) for j in range(4)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found[0] + found[1] == [expected] * 8


def test_channels_first_and_other_views_give_the_same_file_as_contiguous_frames(tmp_path):
    frames = smooth_frames(9, 32, 48, seed=5)
    expected = digest(save_video(frames, tmp_path / "contiguous.mp4", fps=8))
    for i, view in enumerate(strided_views(frames)):
        assert digest(save_video(view, tmp_path / f"view{i}.mp4", fps=8)) == expected, f"view {i}"


def test_a_smooth_clip_decodes_with_imageio_close_to_the_input(tmp_path):
    import imageio.v2 as imageio

    frames = smooth_frames(17, 64, 64, seed=6)
    path = save_video(frames, tmp_path / "clip.mp4", fps=8)
    with imageio.get_reader(path, format="FFMPEG") as reader:
        back = np.stack([frame for frame in reader])  # not list(reader): its len() is inf

    assert back.shape == frames.shape and back.dtype == np.uint8
    mse = np.mean((back.astype(np.float64) - frames) ** 2)
    psnr = 10 * np.log10(255**2 / mse)
    assert psnr > 35.0, f"PSNR {psnr:.1f} dB"


def test_without_pyav_the_ffmpeg_subprocess_writes_the_same_kind_of_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    assert not mp4.have_pyav()
    frames = smooth_frames(9, 33, 47, seed=7)
    path = save_video(frames, tmp_path / "clip.mp4", fps=12)

    atoms = mp4_top_level_atoms(path.read_bytes())
    assert atoms.index("moov") < atoms.index("mdat")
    info = ffmpeg_stream_info(path)
    assert (info["codec"], info["pix_fmt"], info["width"], info["height"]) == ("h264", "yuv420p", 48, 34)
    assert info["frames"] == 9 and info["fps"] == pytest.approx(12)
    assert mp4.count_mp4_frames(path) == 9
    assert np.abs(read_video(path)[:, :33, :47].astype(np.int16) - frames).mean() < 4.0


@needs_pyav
def test_both_writers_give_the_same_stream_properties(tmp_path, monkeypatch):
    frames = smooth_frames(17, 64, 64, seed=8)
    in_process = ffmpeg_stream_info(save_video(frames, tmp_path / "pyav.mp4", fps=24))
    monkeypatch.setitem(sys.modules, "av", None)
    subprocess = ffmpeg_stream_info(save_video(frames, tmp_path / "ffmpeg.mp4", fps=24))
    assert in_process == subprocess
