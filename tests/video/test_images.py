"""``metainfer_gen.video.images``: reference images of any mode and size, fitted to the model's grid."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw

from metainfer_gen.video.images import fit_image, load_image

WHITE = (255, 255, 255)


def random_rgb(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def as_array(image: Image.Image) -> np.ndarray:
    assert isinstance(image, Image.Image) and image.mode == "RGB"
    return np.asarray(image)


def test_rgb_image_is_returned_unchanged():
    pixels = random_rgb(12, 20)
    np.testing.assert_array_equal(as_array(load_image(Image.fromarray(pixels))), pixels)


def test_rgba_is_composited_on_white():
    rng = np.random.default_rng(1)
    rgb = random_rgb(10, 14, seed=2)
    alpha = rng.integers(0, 256, (10, 14), dtype=np.uint8)
    alpha[0, 0], alpha[0, 1] = 0, 255
    rgba = np.dstack([rgb, alpha])

    out = as_array(load_image(Image.fromarray(rgba, mode="RGBA"))).astype(np.float64)
    a = alpha[..., None] / 255.0
    expected = rgb * a + 255.0 * (1 - a)
    assert np.abs(out - expected).max() <= 1.0
    assert tuple(out[0, 0]) == WHITE  # fully transparent -> white, not black
    np.testing.assert_array_equal(out[0, 1], rgb[0, 1])  # opaque -> unchanged


def test_la_is_composited_on_white():
    gray = np.random.default_rng(3).integers(0, 256, (6, 6), dtype=np.uint8)
    alpha = np.zeros_like(gray)
    alpha[:, :3] = 255
    out = as_array(load_image(Image.fromarray(np.dstack([gray, alpha]), mode="LA")))
    np.testing.assert_array_equal(out[:, :3], np.repeat(gray[:, :3, None], 3, axis=2))
    assert (out[:, 3:] == 255).all()


def test_grayscale_becomes_three_equal_channels():
    gray = np.random.default_rng(4).integers(0, 256, (9, 7), dtype=np.uint8)
    out = as_array(load_image(Image.fromarray(gray, mode="L")))
    assert out.shape == (9, 7, 3)
    for channel in range(3):
        np.testing.assert_array_equal(out[..., channel], gray)


@pytest.mark.parametrize("from_file", [False, True])
def test_palette_with_transparency_is_composited_on_white(tmp_path, from_file):
    rng = np.random.default_rng(5)
    indices = rng.integers(0, 4, (8, 8), dtype=np.uint8)
    indices[0, 0] = 0
    palette = [0, 0, 0, 200, 30, 10, 10, 180, 40, 20, 40, 220]  # index 0 (black) is the transparent one
    image = Image.fromarray(indices, mode="P")
    image.putpalette(palette + [0] * (768 - len(palette)))
    image.info["transparency"] = 0
    if from_file:
        image.save(tmp_path / "logo.png", transparency=0)
        image = tmp_path / "logo.png"

    out = as_array(load_image(image))
    colours = np.array(palette, dtype=np.uint8).reshape(-1, 3)
    expected = colours[indices]
    expected[indices == 0] = WHITE
    np.testing.assert_array_equal(out, expected)


def test_palette_without_transparency_keeps_its_colours():
    indices = np.random.default_rng(6).integers(0, 3, (5, 5), dtype=np.uint8)
    palette = [0, 0, 0, 255, 0, 0, 0, 0, 255]
    image = Image.fromarray(indices, mode="P")
    image.putpalette(palette + [0] * (768 - len(palette)))
    expected = np.array(palette, dtype=np.uint8).reshape(-1, 3)[indices]
    np.testing.assert_array_equal(as_array(load_image(image)), expected)


def test_uint8_arrays_of_every_supported_shape():
    rng = np.random.default_rng(7)
    gray = rng.integers(0, 256, (6, 10), dtype=np.uint8)
    rgb = random_rgb(6, 10, seed=8)

    np.testing.assert_array_equal(as_array(load_image(gray)), np.repeat(gray[..., None], 3, axis=2))
    np.testing.assert_array_equal(as_array(load_image(gray[..., None])), np.repeat(gray[..., None], 3, axis=2))
    np.testing.assert_array_equal(as_array(load_image(rgb)), rgb)
    opaque = np.dstack([rgb, np.full((6, 10), 255, np.uint8)])
    np.testing.assert_array_equal(as_array(load_image(opaque)), rgb)
    clear = np.dstack([rgb, np.zeros((6, 10), np.uint8)])
    assert (as_array(load_image(clear)) == 255).all()


def test_loads_from_path_and_str(tmp_path):
    pixels = random_rgb(11, 13, seed=9)
    Image.fromarray(pixels).save(tmp_path / "ref.png")
    np.testing.assert_array_equal(as_array(load_image(tmp_path / "ref.png")), pixels)
    np.testing.assert_array_equal(as_array(load_image(str(tmp_path / "ref.png"))), pixels)


def test_missing_path_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.png"):
        load_image(tmp_path / "nope.png")


def test_non_image_file_raises_value_error(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not an image at all\n")
    with pytest.raises(ValueError, match="notes.png"):
        load_image(path)


@pytest.mark.parametrize("array", [
    np.random.default_rng(0).random((8, 8, 3)),  # float in [0, 1]
    np.random.default_rng(0).integers(0, 256, (8, 8, 3)).astype(np.int64),
    np.random.default_rng(0).integers(0, 256, (8, 8, 2), dtype=np.uint8),
    np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8),
])
def test_bad_arrays_raise_value_error_naming_uint8(array):
    with pytest.raises(ValueError, match="uint8"):
        load_image(array)


@pytest.mark.parametrize("bad", [None, 3, [[0, 1], [2, 3]], b"\x89PNG"])
def test_other_types_raise_type_error(bad):
    with pytest.raises(TypeError, match="image must be"):
        load_image(bad)


@pytest.mark.parametrize("src_size, target", [((90, 30), (32, 32)), ((30, 90), (32, 32)), ((99, 31), (48, 16)),
                                              ((640, 480), (16, 64)), ((17, 1000), (64, 32))])
def test_fit_returns_the_target_size_in_rgb(src_size, target):
    width, height = target
    image = Image.fromarray(random_rgb(src_size[1], src_size[0], seed=sum(src_size)))
    out = fit_image(image, height, width)
    assert out.size == (width, height) and out.mode == "RGB"


def test_fit_centre_crops_a_wide_image_instead_of_squeezing_it():
    # Three 30-pixel stripes: a square target keeps only the middle one.
    stripes = np.zeros((30, 90, 3), np.uint8)
    stripes[:, :30] = (255, 0, 0)
    stripes[:, 30:60] = (0, 255, 0)
    stripes[:, 60:] = (0, 0, 255)
    out = as_array(fit_image(Image.fromarray(stripes), 32, 32)).astype(np.int16)
    assert np.abs(out - np.array([0, 255, 0])).max() <= 2


def test_fit_centre_crops_a_tall_image_instead_of_squeezing_it():
    stripes = np.zeros((90, 30, 3), np.uint8)
    stripes[:30] = (255, 0, 0)
    stripes[30:60] = (0, 255, 0)
    stripes[60:] = (0, 0, 255)
    out = as_array(fit_image(Image.fromarray(stripes), 48, 48)).astype(np.int16)
    assert np.abs(out - np.array([0, 255, 0])).max() <= 2


@pytest.mark.parametrize("src_size, target", [((300, 100), (64, 64)), ((100, 300), (64, 32)), ((257, 131), (48, 80))])
def test_fit_keeps_circles_round(src_size, target):
    # A circle inside the central crop must stay a circle: equal width and height after fitting.
    src_w, src_h = src_size
    width, height = target
    radius = 0.3 * min(src_w, src_h, src_h * width / height, src_w * height / width)
    image = Image.new("RGB", src_size, (0, 0, 0))
    cx, cy = src_w / 2, src_h / 2
    ImageDraw.Draw(image).ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=(255, 255, 255))

    out = as_array(fit_image(image, height, width))[..., 0] > 127
    rows, cols = np.nonzero(out)
    box_h, box_w = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
    assert abs(int(box_h) - int(box_w)) <= 1, (box_w, box_h)
    assert box_h >= 8  # the circle survived at a sensible size


def test_fit_of_the_same_aspect_only_resizes():
    pixels = random_rgb(32, 64, seed=12)
    image = Image.fromarray(pixels)
    np.testing.assert_array_equal(as_array(fit_image(image, 32, 64)), pixels)
    halved = as_array(fit_image(image, 16, 32))
    expected = as_array(image.resize((32, 16), Image.LANCZOS))
    np.testing.assert_array_equal(halved, expected)


# High-bit-depth images: scaled to 8 bits by their bit depth, never clipped to white (I;16 and I: 0..65535 -> 0..255;
# F: 0..1 -> 0..255 when it lies in [0, 1], else its own range from min(0, its minimum) to its maximum).
def gradient16(height: int = 24, width: int = 40, high: int = 20_000) -> np.ndarray:
    """uint16 pixels in 0..high, mean about high / 2: far above 255, where a plain 8-bit conversion clips."""
    ramp = np.linspace(0, high, height * width).reshape(height, width)
    return np.random.default_rng(13).permutation(ramp.ravel()).reshape(height, width).round().astype(np.uint16)


def test_16_bit_png_is_scaled_by_its_bit_depth(tmp_path):
    pixels = gradient16()
    Image.fromarray(pixels).save(tmp_path / "deep.png")  # mode I;16
    with Image.open(tmp_path / "deep.png") as opened:
        assert opened.mode == "I;16"
    out = as_array(load_image(tmp_path / "deep.png")).astype(np.float64)
    expected = pixels / 257.0  # 65535 -> 255
    assert abs(out.mean() - expected.mean()) <= 0.5, (out.mean(), expected.mean())
    assert np.abs(out[..., 0] - expected).max() <= 0.5 and (out[..., 0] == out[..., 2]).all()
    fitted = as_array(fit_image(load_image(tmp_path / "deep.png"), 16, 16)).astype(np.float64)
    assert abs(fitted.mean() - expected.mean()) <= 3.0, (fitted.mean(), expected.mean())


def test_32_bit_integer_image_is_scaled_from_16_bits():
    pixels = gradient16(high=60_000)
    image = Image.fromarray(pixels.astype(np.int32))
    assert image.mode == "I"
    out = as_array(load_image(image)).astype(np.float64)
    assert np.abs(out[..., 1] - pixels / 257.0).max() <= 0.5


def test_32_bit_integer_image_beyond_16_bits_uses_its_own_range():
    pixels = gradient16(high=50_000).astype(np.int32) * 4  # up to 200000: more than 16 bits
    out = as_array(load_image(Image.fromarray(pixels))).astype(np.float64)
    assert np.abs(out[..., 0] - pixels * 255.0 / pixels.max()).max() <= 0.5


@pytest.mark.parametrize("from_file", [False, True])
def test_float_image_in_0_1_is_scaled_to_255(tmp_path, from_file):
    pixels = gradient16().astype(np.float32) / 65535.0 * 2.5  # 0..0.76
    image = Image.fromarray(pixels)
    assert image.mode == "F"
    if from_file:
        image.save(tmp_path / "float.tiff")
        image = tmp_path / "float.tiff"
    out = as_array(load_image(image)).astype(np.float64)
    assert abs(out.mean() - 255.0 * pixels.mean()) <= 0.5
    assert np.abs(out[..., 2] - 255.0 * pixels).max() <= 0.5


def test_float_image_beyond_1_uses_its_own_range():
    pixels = gradient16().astype(np.float32) / 1000.0  # 0..20: not a 0..1 image
    out = as_array(load_image(Image.fromarray(pixels))).astype(np.float64)
    assert np.abs(out[..., 0] - 255.0 * pixels / pixels.max()).max() <= 0.5
    signed = pixels - 5.0  # -5..15: the minimum maps to black
    out = as_array(load_image(Image.fromarray(signed))).astype(np.float64)
    assert np.abs(out[..., 0] - 255.0 * (signed + 5.0) / 20.0).max() <= 0.5


def test_float_image_with_nan_raises_value_error():
    pixels = np.zeros((4, 4), np.float32)
    pixels[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        load_image(Image.fromarray(pixels))
