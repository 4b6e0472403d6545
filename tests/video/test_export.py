"""``metainfer_gen.video.export``: browser-playable MP4, GIF and PNG folders, written atomically."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from metainfer_gen.video.export import read_video, save_video
from metainfer_gen.video.mp4 import have_pyav
from tests.video.mp4_inspect import ffmpeg_stream_info, mp4_top_level_atoms


def random_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Fresh random uint8 frames (F, H, W, 3)."""
    return np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


def smooth_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Random but low-frequency frames (a 4x4 random grid upsampled) that H.264 at CRF 18 keeps close."""
    rng = np.random.default_rng(seed)
    grid = rng.uniform(30, 225, (num_frames, 4, 4, 3))
    rows = np.linspace(0, 3, height)
    cols = np.linspace(0, 3, width)
    r0, c0 = np.floor(rows).astype(int).clip(0, 2), np.floor(cols).astype(int).clip(0, 2)
    fr, fc = (rows - r0)[None, :, None, None], (cols - c0)[None, None, :, None]
    top = grid[:, r0][:, :, c0] * (1 - fc) + grid[:, r0][:, :, c0 + 1] * fc
    bottom = grid[:, r0 + 1][:, :, c0] * (1 - fc) + grid[:, r0 + 1][:, :, c0 + 1] * fc
    return (top * (1 - fr) + bottom * fr).round().astype(np.uint8)


@pytest.mark.parametrize("num_frames, fps", [(9, 8.0), (17, 24.0), (1, 12.0)])
def test_mp4_is_h264_yuv420p_faststart_with_asked_frames_and_fps(tmp_path, num_frames, fps):
    path = save_video(random_frames(num_frames, 32, 48, seed=num_frames), tmp_path / "clip.mp4", fps=fps)

    assert path == tmp_path / "clip.mp4"
    atoms = mp4_top_level_atoms(path.read_bytes())
    assert atoms[0] == "ftyp"
    assert "moov" in atoms and "mdat" in atoms
    assert atoms.index("moov") < atoms.index("mdat"), f"moov after mdat (no faststart): {atoms}"
    info = ffmpeg_stream_info(path)
    assert info["codec"] == "h264"
    assert info["pix_fmt"] == "yuv420p"
    assert (info["width"], info["height"]) == (48, 32)
    assert info["frames"] == num_frames
    assert info["fps"] == pytest.approx(fps)


def test_mp4_round_trip_keeps_the_pictures(tmp_path):
    frames = smooth_frames(5, 32, 48, seed=3)
    back = read_video(save_video(frames, tmp_path / "clip.mp4", fps=8))

    assert back.shape == frames.shape and back.dtype == np.uint8
    error = np.abs(back.astype(np.int16) - frames.astype(np.int16))
    assert error.mean() < 4.0, f"mean error {error.mean():.2f} too large for CRF 18"
    # Each decoded frame is closest to its own source frame (order and count are kept).
    for i, frame in enumerate(back):
        distances = [np.abs(frame.astype(np.int16) - f.astype(np.int16)).mean() for f in frames]
        assert int(np.argmin(distances)) == i


@pytest.mark.parametrize("height, width", [(33, 47), (31, 32), (32, 45)])
def test_mp4_pads_odd_sizes_to_even_by_repeating_the_edge(tmp_path, height, width):
    frames = smooth_frames(3, height, width, seed=height + width)
    path = save_video(frames, tmp_path / "odd.mp4", fps=8)

    info = ffmpeg_stream_info(path)
    padded_h, padded_w = height + height % 2, width + width % 2
    assert (info["width"], info["height"]) == (padded_w, padded_h)
    assert info["frames"] == 3
    back = read_video(path).astype(np.int16)
    assert back.shape == (3, padded_h, padded_w, 3)
    assert np.abs(back[:, :height, :width] - frames).mean() < 4.0
    # The added row/column repeats the edge rather than adding black.
    assert np.abs(back[:, padded_h - 1, :width] - frames[:, height - 1]).mean() < 6.0
    assert np.abs(back[:, :height, padded_w - 1] - frames[:, :, width - 1]).mean() < 6.0


def test_gif_round_trips_and_loops_at_the_asked_rate(tmp_path):
    from PIL import Image

    # At most 256 colours per frame, so the GIF palette holds every pixel exactly.
    rng = np.random.default_rng(7)
    palette = rng.integers(0, 256, (32, 3), dtype=np.uint8)
    frames = palette[rng.integers(0, len(palette), (5, 20, 30))]
    path = save_video(frames, tmp_path / "clip.gif", fps=10)

    np.testing.assert_array_equal(read_video(path), frames)
    with Image.open(path) as gif:
        assert gif.n_frames == 5
        assert gif.info.get("loop") == 0
        assert gif.info["duration"] == pytest.approx(100, abs=10)  # ms per frame; GIF stores centiseconds


def _gif_durations_ms(path: Path) -> list[int]:
    """Each frame's display time as stored in the file (ms; GIF stores centiseconds)."""
    from PIL import Image, ImageSequence

    with Image.open(path) as gif:
        return [frame.info["duration"] for frame in ImageSequence.Iterator(gif)]


def test_gif_keeps_every_frame_of_a_static_clip(tmp_path):
    frame = random_frames(1, 16, 24, seed=5)[0]
    frames = np.repeat(frame[None], 48, axis=0)
    path = save_video(frames, tmp_path / "still.gif", fps=24)

    back = read_video(path)
    assert back.shape[0] == 48, f"read back {back.shape[0]} frames of 48"
    assert len(_gif_durations_ms(path)) == 48
    held = frames.copy()
    held[10:20] = frames[0] // 2  # a run of identical frames inside a moving clip keeps its length too
    assert read_video(save_video(held, tmp_path / "held.gif", fps=24)).shape[0] == 48


@pytest.mark.parametrize("num_frames, fps", [(48, 24.0), (17, 8.0), (81, 16.0), (30, 30.0), (7, 12.5), (5, 3.0)])
def test_gif_total_duration_is_num_frames_over_fps(tmp_path, num_frames, fps):
    path = save_video(random_frames(num_frames, 8, 8, seed=num_frames), tmp_path / "clip.gif", fps=fps)

    durations = _gif_durations_ms(path)
    assert len(durations) == num_frames
    assert abs(sum(durations) - 1000.0 * num_frames / fps) <= 10.0, (sum(durations), durations[:6])
    # Each frame within a centisecond of 1/fps: the rounding is spread, not piled on one frame.
    assert all(abs(d - 1000.0 / fps) <= 10.0 for d in durations), durations


@pytest.mark.parametrize("name", ["clip.mp4", "clip.gif", "frames"])
@pytest.mark.parametrize("fps", [float("nan"), float("inf"), float("-inf"), 0.0, -8.0])
def test_non_finite_or_non_positive_fps_raises_before_any_work(tmp_path, name, fps):
    with pytest.raises(ValueError, match="fps"):
        save_video(random_frames(3, 8, 8), tmp_path / "out" / name, fps=fps)
    assert not (tmp_path / "out").exists()


def test_png_folder_round_trips_exactly(tmp_path):
    frames = random_frames(4, 20, 30, seed=11)
    path = save_video(frames, tmp_path / "frames", fps=8)

    assert path.is_dir()
    assert sorted(p.name for p in path.iterdir()) == [f"frame_{i:05d}.png" for i in range(4)]
    np.testing.assert_array_equal(read_video(path), frames)


@pytest.mark.parametrize("name", ["clip.mp4", "clip.gif", "frames"])
def test_writes_leave_only_the_final_file_and_replace_an_existing_one_whole(tmp_path, name):
    folder = tmp_path / "out"
    save_video(random_frames(9, 16, 16, seed=1), folder / name, fps=8)
    new = random_frames(5, 16, 16, seed=2)
    path = save_video(new, folder / name, fps=8)

    assert sorted(os.listdir(folder)) == [name]
    back = read_video(path)
    assert back.shape == new.shape  # the old, longer clip is gone entirely
    if name == "frames":  # lossless: the new pictures exactly
        np.testing.assert_array_equal(back, new)


def test_writes_create_missing_parent_folders(tmp_path):
    path = save_video(random_frames(1, 16, 16), tmp_path / "a" / "b" / "clip.mp4", fps=8)
    assert path.is_file() and ffmpeg_stream_info(path)["frames"] == 1


class _Boom(RuntimeError):
    pass


def _failing_after(calls: int, real):
    """Wrap ``real`` so that its ``calls``-th call raises (after the earlier ones did their work)."""
    count = [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] >= calls:
            raise _Boom("simulated crash mid-write")
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("name", ["clip.mp4", "clip.gif", "frames"])
def test_a_crash_mid_write_keeps_the_old_output_and_leaves_no_temporaries(tmp_path, monkeypatch, name):
    import imageio.v2 as imageio

    folder = tmp_path / "out"
    old = random_frames(5, 16, 16, seed=3)
    save_video(old, folder / name, fps=8)
    before = read_video(folder / name)

    if name == "clip.mp4" and have_pyav():
        import av

        # The third frame's conversion fails: the header and two encoded frames are already in the file.
        failing = _failing_after(3, av.VideoFrame.from_ndarray)
        monkeypatch.setattr(av, "VideoFrame", type("VideoFrame", (), {"from_ndarray": staticmethod(failing)}))
    elif name == "clip.mp4":
        real_get_writer = imageio.get_writer

        def get_writer(*args, **kwargs):
            writer = real_get_writer(*args, **kwargs)
            writer.append_data = _failing_after(2, writer.append_data)
            return writer

        monkeypatch.setattr(imageio, "get_writer", get_writer)
    elif name == "clip.gif":
        from PIL import GifImagePlugin

        # The third frame's encoding fails: the header and two frames are already in the file.
        monkeypatch.setattr(GifImagePlugin, "getdata", _failing_after(3, GifImagePlugin.getdata))
    else:
        monkeypatch.setattr(imageio, "imwrite", _failing_after(3, imageio.imwrite))

    with pytest.raises(_Boom):
        save_video(random_frames(9, 16, 16, seed=4), folder / name, fps=8)

    assert sorted(os.listdir(folder)) == [name]
    np.testing.assert_array_equal(read_video(folder / name), before)


def test_rejects_float_frames(tmp_path):
    frames = np.random.default_rng(0).random((3, 16, 16, 3), dtype=np.float32)
    with pytest.raises(TypeError, match="uint8"):
        save_video(frames, tmp_path / "clip.mp4")
    with pytest.raises(TypeError, match="uint8"):
        save_video(frames.tolist(), tmp_path / "clip.mp4")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("shape", [(16, 16, 3), (3, 16, 16), (3, 16, 16, 4), (3, 16, 16, 1), (0, 16, 16, 3)])
def test_rejects_wrong_shapes(tmp_path, shape):
    frames = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"\(F, H, W, 3\)"):
        save_video(frames, tmp_path / "clip.mp4")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("fps", [0, -8.0])
def test_rejects_non_positive_fps(tmp_path, fps):
    with pytest.raises(ValueError, match="fps"):
        save_video(random_frames(2, 16, 16), tmp_path / "clip.mp4", fps=fps)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["clip.avi", "clip.webm", "clip.png", "clip.MOV"])
def test_rejects_unknown_suffixes(tmp_path, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        save_video(random_frames(2, 16, 16), tmp_path / name)
    assert not any(tmp_path.iterdir())


def test_suffix_is_case_insensitive(tmp_path):
    path = save_video(random_frames(3, 16, 16), tmp_path / "CLIP.MP4", fps=8)
    info = ffmpeg_stream_info(path)
    assert info["codec"] == "h264" and info["frames"] == 3


def test_stats_print_as_one_short_line():
    from metainfer_gen.video.cache.stats import StepCacheStats, StepRecord
    from metainfer_gen.video.output import GenerationStats

    steps = [StepRecord(i, "cond", "transformer", i % 3 == 0, "x", 0.1, None, 0.9) for i in range(30)]
    stats = GenerationStats(seconds=1.234, num_inference_steps=30, transformer_calls=30, peak_memory_mb=812.4,
                            block_evaluations=60, cache=StepCacheStats(policy="auto", steps=steps).to_dict())
    assert str(stats) == ("1.23 s, 30 steps, 30 transformer calls, 60 block evaluations, peak 812 MiB on cpu; "
                          "cache auto: 20 of 30 calls reused")
    assert "steps=" in repr(stats)  # the full record stays in repr
    off = GenerationStats(num_inference_steps=2, cache={"policy": "auto", "num_reused": 0, "num_computed": 4,
                                                       "disabled_reason": "too few steps"})
    assert str(off).endswith("cache auto: 0 of 4 calls reused, off for this call: too few steps")
    assert str(GenerationStats()).endswith("on cpu")


def test_an_output_saved_at_fps_0_is_refused_not_written_at_its_default(tmp_path):
    from metainfer_gen.video.output import GenerationStats, VideoOutput

    out = VideoOutput(np.zeros((5, 16, 16, 3), np.uint8), GenerationStats(device="cpu"), {}, fps=8.0)
    with pytest.raises(ValueError, match="fps must be a finite number > 0"):
        out.save(tmp_path / "clip.mp4", fps=0)
    assert not (tmp_path / "clip.mp4").exists()


def test_write_gif_refuses_no_frames(tmp_path):
    from metainfer_gen.video.gif import write_gif

    with pytest.raises(ValueError, match="at least one frame"):
        write_gif(np.zeros((0, 8, 8, 3), np.uint8), tmp_path / "x.gif", [])
