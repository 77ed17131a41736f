"""Multi-domain datasets: one label space, several input distributions ("domains").

FedD3A (Sec. 3, Sec. 4 "Cross-silo" / "Cross-device Setting") studies federated learning where every
client domain differs from the others and from the server's unlabelled data. A multi-domain dataset is
loaded into a :class:`DomainDataset`: per domain, its own disjoint train and test images (uint8 NCHW) and
int64 labels. :func:`fedray.data.federated.build_federated_data` then pools the client domains, gives the
server its domain, and partitions.

``fmnist_domains``: five domains built from the real Fashion-MNIST by fixed transforms
----------------------------------------------------------------------------------------
Fashion-MNIST is loaded with the ordinary loader (``--data-dir``, Debian's ``dataset-fashion-mnist``,
same errors). Its 60,000 training and 10,000 test images are each dealt into five disjoint, class-balanced
shares by a fixed draw that does not depend on the run seed, so a domain is always the same images:
within each split, a permutation from ``np.random.default_rng([0xFD0A1, split])`` (split 0 = train,
1 = test) is stably sorted by label and share ``i`` takes every fifth image from position ``i``
(1,200 per class per domain in train, 200 in test; 12,000 and 2,000 images per domain). Share ``i`` goes
to the ``i``-th domain of ``config.DOMAINS["fmnist_domains"]``, whatever domains a run selects; then the
domain's transform is applied to its share, in ascending source-index order (``x`` is a uint8 28x28
image, ``u``/``v`` its row/column):

- ``original``: ``x`` unchanged.
- ``rotated``: rotated 90 degrees counter-clockwise, ``out[u, v] = x[v, 27 - u]`` (``np.rot90``, exact).
- ``inverted``: ``255 - x``.
- ``noisy``: ``clip(rint(x + 40 z), 0, 255)`` with ``z`` standard normal float32 noise drawn as one
  ``(n, 1, 28, 28)`` array from ``np.random.default_rng([0x5EED, split])`` (additive Gaussian noise of
  standard deviation 40 grey levels, fixed per image).
- ``blurred``: Gaussian blur with sigma 1 pixel (``scipy.ndimage.gaussian_filter``, ``mode="nearest"``,
  truncated at 4 sigma, in float32), then the contrast is halved around mid-grey:
  ``clip(rint(64 + 0.5 * blur(x)), 0, 255)`` (values in 64..192).

Shapes stay 1x28x28 uint8, 10 classes. Only the run's domains (``data.domains``) are built; ``mean``/``std``
are measured on the client domains' training images (the server's domain excluded).

The ImageFolder datasets (``digit5``, ``office_caltech10``, ``domainnet``) are read by
:mod:`fedray.data.imagefolder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedray.config import DOMAINS, DataConfig
from fedray.data.datasets import RawDataset, load_torchvision, canonical

FMNIST_DOMAINS: tuple[str, ...] = DOMAINS["fmnist_domains"]
# Fixed seeds (never the run seed): a domain must be the same images and the same noise in every run.
_SHARE_SEED = 0xFD0A1
_NOISE_SEED = 0x5EED
NOISE_STD = 40.0  # grey levels: visibly noisy, still learnable by a small CNN
BLUR_SIGMA = 1.0  # pixels
CONTRAST = 0.5  # blurred: 64 + 0.5 * x keeps mid-grey and halves the dynamic range
_STATS_CHUNK = 8192  # images per chunk when measuring mean/std (bounds the float64 working memory)


@dataclass
class DomainSplit:
    """One domain's own train and test images (uint8 NCHW) and labels (int64)."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


@dataclass
class DomainDataset:
    """A multi-domain dataset: ``domains`` maps each of the run's domains, in the run's order, to its data.

    ``mean``/``std`` are per channel, measured on the client domains' training images.
    """

    name: str
    domains: dict[str, DomainSplit]
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classes: tuple[str, ...] = field(default=())

    def pooled(self, names: list[str] | tuple[str, ...]) -> RawDataset:
        """The ``names`` domains concatenated (domain-major) as one :class:`RawDataset`."""
        parts = [self.domains[d] for d in names]
        cat = lambda key, dt: canonical(np.concatenate([getattr(p, key) for p in parts]), dt)  # noqa: E731
        return RawDataset(self.name, cat("train_x", np.uint8), cat("train_y", np.int64),
                          cat("test_x", np.uint8), cat("test_y", np.int64), self.num_classes,
                          self.mean, self.std)


def channel_stats(arrays: list[np.ndarray]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of ``x / 255`` over uint8 NCHW ``arrays``, in float64 chunks."""
    channels = arrays[0].shape[1]
    total = np.zeros(channels)
    squares = np.zeros(channels)
    count = 0
    for a in arrays:
        for start in range(0, len(a), _STATS_CHUNK):
            chunk = a[start : start + _STATS_CHUNK].astype(np.float64) / 255.0
            total += chunk.sum(axis=(0, 2, 3))
            squares += np.square(chunk).sum(axis=(0, 2, 3))
            count += chunk.shape[0] * chunk.shape[2] * chunk.shape[3]
    if count == 0:
        return (0.5,) * channels, (0.25,) * channels
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 1e-12))
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def fmnist_domain_shares(labels: np.ndarray, split: int) -> list[np.ndarray]:
    """The fixed class-balanced five-way split of one Fashion-MNIST split (0 = train, 1 = test).

    Returns one sorted int64 array of source indices per domain of ``FMNIST_DOMAINS``.
    """
    labels = np.asarray(labels)
    perm = np.random.default_rng([_SHARE_SEED, split]).permutation(len(labels))
    by_label = perm[np.argsort(labels[perm], kind="stable")]
    k = len(FMNIST_DOMAINS)
    return [np.sort(by_label[i::k]).astype(np.int64) for i in range(k)]


def fmnist_domain_transform(domain: str, x: np.ndarray, split: int) -> np.ndarray:
    """Apply ``domain``'s fixed transform (module docstring) to uint8 ``(n, 1, 28, 28)`` images ``x``.

    ``split`` (0 = train, 1 = test) selects the noise stream of ``noisy``; the result is a fresh uint8
    array with canonical strides.
    """
    if domain == "original":
        out = x
    elif domain == "rotated":
        out = np.rot90(x, k=1, axes=(2, 3))
    elif domain == "inverted":
        out = 255 - x
    elif domain == "noisy":
        z = np.random.default_rng([_NOISE_SEED, split]).standard_normal(x.shape, dtype=np.float32)
        noisy = x.astype(np.float32) + np.float32(NOISE_STD) * z
        out = np.clip(np.rint(noisy), 0, 255)
    elif domain == "blurred":
        from scipy.ndimage import gaussian_filter

        blur = gaussian_filter(x.astype(np.float32), sigma=(0, 0, BLUR_SIGMA, BLUR_SIGMA), mode="nearest")
        out = np.clip(np.rint(np.float32(128 * (1 - CONTRAST)) + np.float32(CONTRAST) * blur), 0, 255)
    else:
        raise ValueError(f"unknown fmnist_domains domain {domain!r}; known: {', '.join(FMNIST_DOMAINS)}")
    return np.array(out, dtype=np.uint8, order="C", copy=True)


def load_fmnist_domains(cfg: DataConfig) -> DomainDataset:
    """Build the run's ``fmnist_domains`` domains from the real Fashion-MNIST (module docstring)."""
    # The ordinary Fashion-MNIST loader: same data roots, Debian discovery and error messages.
    raw = load_torchvision(cfg.model_copy(update={"dataset": "fashion_mnist"}))
    train_shares = fmnist_domain_shares(raw.train_y, 0)
    test_shares = fmnist_domain_shares(raw.test_y, 1)
    domains: dict[str, DomainSplit] = {}
    for name in cfg.all_domains():
        i = FMNIST_DOMAINS.index(name)
        tr, te = train_shares[i], test_shares[i]
        domains[name] = DomainSplit(
            fmnist_domain_transform(name, raw.train_x[tr], 0), raw.train_y[tr].copy(),
            fmnist_domain_transform(name, raw.test_x[te], 1), raw.test_y[te].copy(),
        )
    mean, std = channel_stats([domains[d].train_x for d in cfg.client_domains()])
    return DomainDataset("fmnist_domains", domains, raw.num_classes, mean, std,
                         classes=tuple(str(c) for c in range(raw.num_classes)))


def is_multi_domain(name: str) -> bool:
    return name in DOMAINS
