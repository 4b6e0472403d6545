"""Quality metrics between clips: PSNR and SSIM on uint8 frames.

SSIM follows Wang et al. 2004 ("Image quality assessment: from error visibility to structural similarity"),
with an 11x11 Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03, computed on luma (BT.601) per frame and averaged,
as scikit-image's ``structural_similarity(gaussian_weights=True)`` does.
"""

from __future__ import annotations

import math

import numpy as np


def _check_pair(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise ValueError(f"clips differ in shape: {a.shape} vs {b.shape}")
    if a.dtype != np.uint8 or b.dtype != np.uint8:
        raise TypeError(f"clips must be uint8; got {a.dtype} and {b.dtype}")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB between two uint8 arrays of equal shape (inf when identical).

    Raises:
        ValueError: shapes differ. TypeError: not uint8.
    """
    _check_pair(a, b)
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def _gaussian_filter(x: np.ndarray, sigma: float = 1.5, radius: int = 5) -> np.ndarray:
    """Separable Gaussian blur of (N, H, W) with reflect padding."""
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    padded = np.pad(x, ((0, 0), (radius, radius), (radius, radius)), mode="reflect")
    rows = sum(taps[i] * padded[:, i:i + x.shape[1], :] for i in range(2 * radius + 1))
    return sum(taps[i] * rows[:, :, i:i + x.shape[2]] for i in range(2 * radius + 1))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM in [-1, 1] between two uint8 clips (F, H, W, 3) or images (H, W, 3), on luma.

    Raises:
        ValueError: shapes differ or frames smaller than 11x11. TypeError: not uint8.
    """
    _check_pair(a, b)
    if a.ndim == 3:
        a, b = a[None], b[None]
    if min(a.shape[1:3]) < 11:
        raise ValueError(f"SSIM needs frames of at least 11x11 pixels; got {a.shape[1:3]}")
    weights = np.array([0.299, 0.587, 0.114])
    x = a.astype(np.float64) @ weights
    y = b.astype(np.float64) @ weights
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = _gaussian_filter(x), _gaussian_filter(y)
    sxx = _gaussian_filter(x * x) - mx * mx
    syy = _gaussian_filter(y * y) - my * my
    sxy = _gaussian_filter(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return float(s.mean())
