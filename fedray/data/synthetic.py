"""A learnable, image-shaped synthetic dataset generated from a seed (for tests and scale runs).

Each class has a smooth random prototype image (low-resolution Gaussian noise upsampled bilinearly, with
std ``contrast`` around 0.5). A sample is its class prototype shifted by up to ``shift`` pixels each way,
plus per-pixel Gaussian noise of std ``noise``, clipped to [0, 1] and quantised to uint8: the label is read
off the image. With the defaults (noise 0.3, shift 2, contrast 0.22) a small CNN (LeNet-5) learns it to
~90%+ in a few hundred SGD steps, and the noise keeps it from being solved after one step. With
``noise=0.1, shift=0, contrast=0.4`` (the every-method tests' setting) LeNet-5 under Adam reads it well
above chance after a few dozen steps. Generation is vectorised: the shifted
prototypes are tabulated once, samples are a table lookup plus noise, in chunks, so 600k 1x16x16
images (10,000 clients x 60) take a few seconds and 150 MB.
"""

from __future__ import annotations

import numpy as np

from fedray.data.datasets import RawDataset

# the defaults: a shift of 2 pixels each way (translation invariance is what a CNN should learn), noise of std 0.3
# on a [0, 1] scale (how hard the task is), prototypes of std 0.22 around 0.5
SHIFT, NOISE, CONTRAST = 2, 0.3, 0.22
_CHUNK = 65536  # samples generated per chunk: bounds the float32 working memory (~64 MB at 16x16)


def _upsample(low: np.ndarray, size: int) -> np.ndarray:
    """Bilinear upsampling of (..., h, h) to (..., size, size) with numpy only (separable)."""
    h = low.shape[-1]
    pos = np.linspace(0, h - 1, size)
    i0 = np.clip(np.floor(pos).astype(int), 0, h - 2)
    w = (pos - i0)[:, None]
    # rows, then columns
    rows = low[..., i0, :] * (1 - w) + low[..., i0 + 1, :] * w
    wc = w[:, 0]
    return rows[..., i0] * (1 - wc) + rows[..., i0 + 1] * wc


def _prototypes(rng: np.random.Generator, num_classes: int, channels: int, size: int,
                contrast: float) -> np.ndarray:
    """(K, C, S, S) smooth prototypes with values around 0.5, of std ``contrast``."""
    low_res = max(3, size // 4)
    low = rng.standard_normal((num_classes, channels, low_res, low_res))
    protos = _upsample(low, size)
    protos = (protos - protos.mean(axis=(1, 2, 3), keepdims=True)) / protos.std(axis=(1, 2, 3), keepdims=True)
    return (0.5 + contrast * protos).astype(np.float32)


def _shift_table(protos: np.ndarray, shift: int) -> np.ndarray:
    """(K, V, C, S, S): each prototype under every (dy, dx) shift in [-shift, shift]^2."""
    shifts = range(-shift, shift + 1)
    table = [np.roll(protos, (dy, dx), axis=(2, 3)) for dy in shifts for dx in shifts]
    return np.stack(table, axis=1)


def _samples(rng: np.random.Generator, table: np.ndarray, labels: np.ndarray, noise: float) -> np.ndarray:
    k, v, c, s, _ = table.shape
    flat = table.reshape(k * v, c, s, s)
    out = np.empty((len(labels), c, s, s), dtype=np.uint8)
    for start in range(0, len(labels), _CHUNK):
        y = labels[start : start + _CHUNK]
        variant = rng.integers(0, v, size=len(y))
        x = flat[y * v + variant]
        x += rng.standard_normal(x.shape, dtype=np.float32) * np.float32(noise)
        np.clip(x, 0.0, 1.0, out=x)
        out[start : start + len(y)] = np.rint(x * 255.0)
    return out


def _balanced_labels(rng: np.random.Generator, n: int, num_classes: int) -> np.ndarray:
    return rng.permutation(np.arange(n, dtype=np.int64) % num_classes)


def make_synthetic(
    num_train: int, num_test: int, num_classes: int, channels: int, image_size: int, seed: int, *,
    noise: float = NOISE, shift: int = SHIFT, contrast: float = CONTRAST,
) -> RawDataset:
    """Generate a synthetic :class:`RawDataset`; identical output for the same arguments.

    Labels are balanced (counts differ by at most one). ``mean``/``std`` are measured on (up to the
    first 20,000) training images, as the published statistics are for real datasets.
    """
    rng = np.random.default_rng([seed, 0xDA7A])
    table = _shift_table(_prototypes(rng, num_classes, channels, image_size, contrast), shift)
    train_y = _balanced_labels(rng, num_train, num_classes)
    test_y = _balanced_labels(rng, num_test, num_classes)
    train_x = _samples(rng, table, train_y, noise)
    test_x = _samples(rng, table, test_y, noise)
    probe = train_x[:20000].astype(np.float64) / 255.0
    mean = tuple(float(m) for m in probe.mean(axis=(0, 2, 3)))
    std = tuple(float(s) for s in probe.std(axis=(0, 2, 3)))
    return RawDataset("synthetic", train_x, train_y, test_x, test_y, num_classes, mean, std)
