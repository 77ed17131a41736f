"""Dataset loading: torchvision's own dataset classes on an offline-friendly root, plus synthetic data.

Every loader returns a :class:`RawDataset` of uint8 NCHW arrays; normalisation happens later, per batch,
in :func:`fedray.data.federated.to_float` (so 10,000 clients share one compact uint8 copy).

Where the data comes from (``resolve_root``): ``data.data_dir`` if given (it must exist), else
``$FEDRAY_DATA_DIR``, else ``~/.cache/fedray/data``; inside it, torchvision's own layout
(``FashionMNIST/raw/...``, ``cifar-10-batches-py/...``, ``train_32x32.mat`` ...). For Fashion-MNIST,
Debian's ``dataset-fashion-mnist`` package is found and decompressed into that layout once, so the
default experiment runs offline.

Multi-domain datasets live in :mod:`fedray.data.domains` (``fmnist_domains``, built from Fashion-MNIST
loaded here) and :mod:`fedray.data.imagefolder` (``digit5``, ``office_caltech10``, ``domainnet``, read
from ``<data_dir>/<dataset>/<domain>/<class>/<image>``).
"""

from __future__ import annotations

import gzip
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.error import URLError

import numpy as np

from fedray.config import DataConfig
from fedray.data.cache import DecodedCache, default_cache_dir, fingerprint
from fedray.errors import DataError
from fedray.paths import DATA_DIR_ENV

#: Where Debian's ``dataset-fashion-mnist`` installs the four gzipped IDX files.
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
#: Environment variable that overrides :data:`DEBIAN_FASHION_MNIST` (tests point it at a fake folder).
DEBIAN_FASHION_MNIST_ENV = "FEDRAY_DEBIAN_FASHION_MNIST"

# torchvision's unzipped raw file names for Fashion-MNIST (FashionMNIST._check_exists looks for these).
_FMNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

# Standard published per-channel mean/std of x/255 over each training set.
TORCHVISION_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "emnist": ((0.1751,), (0.3332,)),  # EMNIST-balanced; the other splits differ by < 0.003
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}

_DISPLAY = {
    "fashion_mnist": "Fashion-MNIST",
    "mnist": "MNIST",
    "emnist": "EMNIST",
    "svhn": "SVHN",
    "cifar10": "CIFAR-10",
    "cifar100": "CIFAR-100",
    "fmnist_domains": "Fashion-MNIST domains",
    "digit5": "Digit-5",
    "office_caltech10": "Office-Caltech-10",
    "domainnet": "DomainNet",
}


@dataclass
class RawDataset:
    """A dataset's train and test splits as uint8 ``(N, C, H, W)`` images and int64 labels."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def resolve_root(cfg: DataConfig) -> Path:
    """The folder holding datasets in torchvision's layout.

    ``data.data_dir`` must already exist (a typo should not silently trigger a download elsewhere);
    ``$FEDRAY_DATA_DIR`` and the default cache folder are created when missing.
    """
    if cfg.data_dir is not None:
        root = Path(cfg.data_dir).expanduser()
        if not root.is_dir():
            raise DataError(
                "data.data_dir",
                f"{root} does not exist or is not a folder; create it or pass --data-dir pointing at a "
                "torchvision-layout copy of the dataset",
            )
        return root
    env = os.environ.get(DATA_DIR_ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "fedray" / "data"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            "data.data_dir",
            f"cannot create the default data folder {root} ({e.strerror or e}); pass --data-dir "
            f"or set ${DATA_DIR_ENV} to a writable folder",
        ) from None
    return root


def debian_fashion_mnist_dir() -> Path:
    """Debian's Fashion-MNIST folder (``$FEDRAY_DEBIAN_FASHION_MNIST`` overrides the constant)."""
    return Path(os.environ.get(DEBIAN_FASHION_MNIST_ENV) or DEBIAN_FASHION_MNIST)


def _install_debian_fashion_mnist(root: Path) -> None:
    """Decompress Debian's gzipped IDX files into ``root/FashionMNIST/raw`` if that is incomplete.

    Each file is written under a unique temporary name in the same folder and then renamed (atomic on
    POSIX), so an interrupted or concurrent copy (several Ray workers) never leaves a file that looks
    complete to torchvision, which only checks that the four files exist.
    """
    raw = root / "FashionMNIST" / "raw"
    missing = [f for f in _FMNIST_FILES if not (raw / f).is_file()]
    src = debian_fashion_mnist_dir()
    if not missing or not all((src / f"{f}.gz").is_file() for f in missing):
        return
    try:
        raw.mkdir(parents=True, exist_ok=True)
        for name in missing:
            fd, tmp = tempfile.mkstemp(dir=raw, prefix=f".{name}.", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out, gzip.open(src / f"{name}.gz", "rb") as gz:
                    shutil.copyfileobj(gz, out, length=1 << 20)
                os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared data root must stay readable
                os.replace(tmp, raw / name)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except (OSError, EOFError) as e:
        raise DataError(
            "data.data_dir",
            f"could not copy Debian's Fashion-MNIST from {src} into {raw} ({e}); pass --data-dir "
            "pointing at a writable folder, or reinstall dataset-fashion-mnist if its files are damaged",
        ) from None


def _short(e: BaseException) -> str:
    """The most telling line of a torchvision/urllib error (its last non-empty line), shortened."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[-1] if lines else type(e).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _is_missing(e: RuntimeError) -> bool:
    """torchvision reports missing files and failed downloads as RuntimeErrors saying so."""
    text = str(e).lower()
    return "not found" in text or "download" in text


def _unreadable(name: str, root: Path, e: BaseException) -> DataError:
    return DataError(
        "data.dataset",
        f"{name} files under {root} could not be read ({_short(e)}); they look corrupt: delete them "
        "and download again, or pass --data-dir pointing at a good copy",
    )


def _torchvision(cfg: DataConfig, root: Path):
    """Construct the torchvision train and test dataset objects for ``cfg.dataset``."""
    from torchvision import datasets as tvd

    kw = dict(root=str(root), download=cfg.download)
    name = cfg.dataset
    if name == "svhn":
        return tvd.SVHN(split="train", **kw), tvd.SVHN(split="test", **kw)
    if name == "emnist":
        return (
            tvd.EMNIST(split=cfg.emnist_split, train=True, **kw),
            tvd.EMNIST(split=cfg.emnist_split, train=False, **kw),
        )
    cls = {
        "fashion_mnist": tvd.FashionMNIST,
        "mnist": tvd.MNIST,
        "cifar10": tvd.CIFAR10,
        "cifar100": tvd.CIFAR100,
    }[name]
    return cls(train=True, **kw), cls(train=False, **kw)


def _arrays(name: str, ds) -> tuple[np.ndarray, np.ndarray]:
    """A torchvision dataset's ``data``/``targets`` as uint8 NCHW (C-contiguous) and int64 labels."""
    if name == "svhn":
        x, y = np.asarray(ds.data), np.asarray(ds.labels)  # already NCHW; 10 -> 0 done by torchvision
    elif name in ("cifar10", "cifar100"):
        x, y = np.asarray(ds.data).transpose(0, 3, 1, 2), np.asarray(ds.targets)  # NHWC -> NCHW
    else:
        x, y = ds.data.numpy(), ds.targets.numpy()
        if name == "emnist":
            x = x.transpose(0, 2, 1)  # EMNIST's IDX files store each image transposed
        x = x[:, None]
    # A fresh C-order copy: ascontiguousarray keeps odd strides on the size-1 channel axis, which torch
    # reads as channels-last and then convolves with another kernel than after a round trip through
    # Ray's object store (which normalises strides), breaking local == ray bit-equality.
    return canonical(x, np.uint8), canonical(y, np.int64)


def canonical(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype`` in C order with canonical strides (copied only when needed)."""
    a = np.asarray(a, dtype=dtype)
    want = np.empty(0, dtype=dtype).itemsize * np.cumprod((a.shape[1:] + (1,))[::-1])[::-1]
    if a.flags["C_CONTIGUOUS"] and a.strides == tuple(int(s) for s in want):
        return a
    return np.array(a, dtype=dtype, order="C", copy=True)


# Each dataset's files under the root (torchvision's layout): what the decoded cache is keyed on.
_SOURCES = {
    "fashion_mnist": ("FashionMNIST/raw",), "mnist": ("MNIST/raw",), "emnist": ("EMNIST/raw",),
    "cifar10": ("cifar-10-batches-py",), "cifar100": ("cifar-100-python",),
    "svhn": ("train_32x32.mat", "test_32x32.mat"),
}


def _cache_for(cfg: DataConfig, root: Path) -> tuple[DecodedCache | None, str | None]:
    """The decoded cache of ``cfg.dataset`` and the key of its current source files (None: no cache, or the
    files are not there yet)."""
    if not cfg.cache:
        return None, None
    label = cfg.dataset + (f"-{cfg.emnist_split}" if cfg.dataset == "emnist" else "")
    cache = DecodedCache(Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(), label)
    return cache, fingerprint(label, [root / s for s in _SOURCES[cfg.dataset]], root)


def load_torchvision(cfg: DataConfig) -> RawDataset:
    """``cfg.dataset`` from the decoded cache (``fedray.data.cache``) when its source files are unchanged;
    else decoded by torchvision, and cached."""
    name = cfg.dataset
    root = resolve_root(cfg)
    if name == "fashion_mnist":
        _install_debian_fashion_mnist(root)
    cache, key = _cache_for(cfg, root)
    hit = cache.load(key) if cache is not None and key is not None else None
    if hit is not None:
        arrays, meta = hit
        return RawDataset(name, **arrays, num_classes=int(meta["num_classes"]), mean=tuple(meta["mean"]),
                          std=tuple(meta["std"]))
    raw = _decode_torchvision(cfg, root)
    if cache is not None:
        key = key or fingerprint(cache.label, [root / s for s in _SOURCES[name]], root)  # after a download
        if key is not None:
            cache.save(key, {a: getattr(raw, a) for a in ("train_x", "train_y", "test_x", "test_y")},
                       {"num_classes": raw.num_classes, "mean": list(raw.mean), "std": list(raw.std)})
    return raw


def _decode_torchvision(cfg: DataConfig, root: Path) -> RawDataset:
    name = cfg.dataset
    try:
        train, test = _torchvision(cfg, root)
    except (URLError, RuntimeError, OSError) as e:
        if isinstance(e, RuntimeError) and not _is_missing(e):
            raise _unreadable(name, root, e) from None
        why = "data.download is false" if not cfg.download else f"download failed: {_short(e)}"
        raise DataError(
            "data.dataset",
            f"{name} not found under {root} and could not be downloaded ({why}); pass --data-dir "
            "pointing at a torchvision-layout copy, or for fashion_mnist install Debian's "
            "dataset-fashion-mnist",
        ) from None
    except (ValueError, TypeError, AssertionError, EOFError, KeyError, pickle.UnpicklingError) as e:
        raise _unreadable(name, root, e) from None
    train_x, train_y = _arrays(name, train)
    test_x, test_y = _arrays(name, test)
    # SVHN has no ``classes`` attribute in torchvision: its ten digits are labelled 0..9.
    num_classes = 10 if name == "svhn" else len(train.classes)
    if name == "emnist" and cfg.emnist_split == "letters":
        # torchvision keeps letters' labels 1..26 (classes[0] is "N/A"); make them 0..25.
        train_y, test_y, num_classes = train_y - 1, test_y - 1, 26
    mean, std = TORCHVISION_STATS[name]
    return RawDataset(name, train_x, train_y, test_x, test_y, num_classes, mean, std)


# (channels, classes) of each dataset's images as fedray loads them; 28x28 unless the dataset says otherwise.
_EMNIST_CLASSES = {"balanced": 47, "byclass": 62, "bymerge": 47, "digits": 10, "letters": 26, "mnist": 10}
_SHAPES: dict[str, tuple[int, int, int]] = {  # channels, side, classes
    "fashion_mnist": (1, 28, 10), "mnist": (1, 28, 10), "fmnist_domains": (1, 28, 10),
    "svhn": (3, 32, 10), "cifar10": (3, 32, 10), "cifar100": (3, 32, 100),
    "digit5": (3, 32, 10), "office_caltech10": (3, 32, 10), "domainnet": (3, 32, 345),
}


def input_spec(cfg: DataConfig) -> tuple[tuple[int, int, int], int]:
    """((C, H, W), classes) of ``cfg.dataset`` as fedray loads it, without loading it (``fedray models``)."""
    if cfg.dataset == "synthetic":
        s = cfg.synthetic_image_size
        return (cfg.synthetic_channels, s, s), cfg.synthetic_num_classes
    if cfg.dataset == "emnist":
        return (1, 28, 28), _EMNIST_CLASSES[cfg.emnist_split]
    c, side, classes = _SHAPES[cfg.dataset]
    if cfg.dataset in ("digit5", "office_caltech10", "domainnet"):
        side = cfg.image_size or side
    return (c, side, side), classes


def display_name(name: str) -> str:
    """Human-readable dataset name for titles and reports."""
    return _DISPLAY.get(name, name)
