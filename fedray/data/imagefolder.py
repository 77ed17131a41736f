"""Multi-domain ImageFolder datasets: ``digit5``, ``office_caltech10``, ``domainnet`` (never downloaded).

FedD3A (Sec. 4, "Datasets and Models") evaluates on Digit-5 and DomainNet, one domain per client in the
cross-silo setting. These datasets have no torchvision loader, so users who have them arrange them as
torchvision ``ImageFolder`` trees, one per domain, and pass ``--data-dir``:

    <data_dir>/<dataset>/<domain>/<class>/<image>                 (no split given)
    <data_dir>/<dataset>/<domain>/train/<class>/<image>           (split given: both folders needed)
    <data_dir>/<dataset>/<domain>/test/<class>/<image>

for example ``digit5/usps/7/00012.png`` or ``domainnet/clipart/train/airplane/clipart_001_000001.jpg``.
``<domain>`` is a name of ``config.DOMAINS[<dataset>]``; only the run's domains (``data.domains``) are
read. A domain folder holding a ``train`` or a ``test`` subfolder is read as split (both must exist);
otherwise its images are split here by a fixed draw (seeded by the domain's name, never by the run
seed): ``round(0.2 n_c)`` images of each class ``c`` go to the domain's test share, the rest to its
training share. Every domain (and both halves of a split domain) must hold the same set of class folders;
labels are the class folders' indices in sorted order (ImageFolder's ``class_to_idx``).

Images are read by ``torchvision.datasets.ImageFolder`` with the PIL loader (any extension it accepts:
png, jpg, bmp, ...), converted to RGB (grayscale and palette images get three equal or mapped channels,
alpha is dropped), resized to ``data.image_size`` (default 32) square with bilinear filtering (aspect
ratio is not kept) and stored as uint8 ``(N, 3, S, S)``. ``mean``/``std`` are measured on the client
domains' training images.

Decoding is cached per domain in ``<domain>/.fedray-cache-<S>px.npz``, keyed by the image size and each
file's path, size and modification time, so editing, adding or removing an image rebuilds it; a folder
that cannot be written is simply not cached.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fedray.config import DataConfig
from fedray.data.datasets import canonical, resolve_root
from fedray.data.domains import DomainDataset, DomainSplit, channel_stats
from fedray.errors import DataError

IMAGEFOLDER_DATASETS = ("digit5", "office_caltech10", "domainnet")
DEFAULT_IMAGE_SIZE = 32
TEST_SHARE = 0.2  # of each class, for domains without their own train/test folders
_TEST_SEED = 0x1F0D  # fixed: a domain's test share is the same images in every run
_CACHE_VERSION = 1  # bump when decoding changes, so old caches are rebuilt


def _layout(dataset: str, root: Path) -> str:
    return (f"{root}/{dataset}/<domain>/<class>/<image> (or <domain>/train/<class>/<image> and "
            f"<domain>/test/<class>/<image>)")


def _missing(dataset: str, domain: str, root: Path, what: str) -> DataError:
    return DataError(
        "data.data_dir",
        f"{dataset} domain {domain!r} not found: expected {root / dataset / domain}/<class>/<image> (or "
        f"{root / dataset / domain}/train/<class>/<image> and .../test/<class>/<image>); {what}. Pass "
        f"--data-dir pointing at a folder laid out as {_layout(dataset, Path('<data_dir>'))}; "
        f"{dataset} is never downloaded",
    )


def _open_folder(dataset: str, domain: str, folder: Path, root: Path):
    """``ImageFolder(folder)`` with the PIL loader; its errors become DataErrors naming the folder."""
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import pil_loader

    try:
        return ImageFolder(str(folder), loader=pil_loader)
    except (FileNotFoundError, OSError) as e:
        # "Couldn't find any class folder in ..." / "Found no valid file for the classes ..."
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _missing(dataset, domain, root, f"{folder} has no readable class folders with images "
                       f"({text})") from None


def _read_rgb(path: str, size: int) -> np.ndarray:
    from PIL import Image

    with open(path, "rb") as f:
        img = Image.open(f)
        img = img.convert("RGB")
    img = img.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(img, dtype=np.uint8)


def _decode(dataset: str, samples: list[tuple[str, int]], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``samples`` (ImageFolder's sorted ``(path, label)`` list) to uint8 (N, 3, S, S), int64."""
    from PIL import UnidentifiedImageError

    def read(path: str) -> np.ndarray:
        try:
            return _read_rgb(path, size)
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise DataError("data.data_dir", f"{dataset}: cannot read image {path} ({e}); delete or "
                            "replace it") from None

    # PIL decodes and resizes without the GIL, so threads overlap; map keeps the order.
    workers = max(1, min(8, os.cpu_count() or 1))
    paths = [p for p, _ in samples]
    if len(paths) > 64 and workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            images = list(pool.map(read, paths, chunksize=64))
    else:
        images = [read(p) for p in paths]
    x = np.stack(images).transpose(0, 3, 1, 2) if images else np.zeros((0, 3, size, size), np.uint8)
    y = np.array([t for _, t in samples], dtype=np.int64)
    return canonical(x, np.uint8), y


def fixed_test_share(labels: np.ndarray, domain: str) -> np.ndarray:
    """Sorted indices of the fixed test share of an unsplit domain: ``round(0.2 n_c)`` per class ``c``.

    Seeded by the domain's name only, so the split never changes between runs.
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng([_TEST_SEED, zlib.crc32(domain.encode())])
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    classes, starts, counts = np.unique(labels[order], return_index=True, return_counts=True)
    take = np.floor(TEST_SHARE * counts + 0.5).astype(np.int64)  # round half up
    picked = [order[s : s + t] for s, t in zip(starts, take)]
    return np.sort(np.concatenate(picked)).astype(np.int64) if picked else np.zeros(0, np.int64)


def _fingerprint(folder: Path, samples: list[tuple[str, int]], classes: list[str], size: int) -> str:
    h = hashlib.sha256(f"v{_CACHE_VERSION} {size} {TEST_SHARE} {_TEST_SEED}\n".encode())
    h.update("\0".join(classes).encode() + b"\n")
    for path, label in samples:
        st = os.stat(path)
        h.update(f"{os.path.relpath(path, folder)}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _cache_path(folder: Path, size: int) -> Path:
    return folder / f".fedray-cache-{size}px.npz"


def _read_cache(path: Path, key: str) -> tuple[list[str], DomainSplit] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["fingerprint"]) != key:
                return None
            split = DomainSplit(canonical(z["train_x"], np.uint8), canonical(z["train_y"], np.int64),
                                canonical(z["test_x"], np.uint8), canonical(z["test_y"], np.int64))
            return [str(c) for c in z["classes"]], split
    except (OSError, KeyError, ValueError, EOFError, zlib.error):
        return None  # absent, stale or damaged: decode again


def _write_cache(path: Path, key: str, classes: list[str], split: DomainSplit) -> None:
    """Write atomically (temporary file, then rename); a read-only dataset folder is not an error."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".part")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, fingerprint=np.array(key), classes=np.array(classes, dtype=str),
                     train_x=split.train_x, train_y=split.train_y, test_x=split.test_x, test_y=split.test_y)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def load_imagefolder_domain(
    dataset: str, domain: str, root: Path, size: int
) -> tuple[list[str], DomainSplit]:
    """One domain's classes and its train/test images (module docstring for the layout and split)."""
    folder = root / dataset / domain
    if not (root / dataset).is_dir():
        raise _missing(dataset, domain, root, f"{root / dataset} does not exist")
    if not folder.is_dir():
        have = sorted(p.name for p in (root / dataset).iterdir() if p.is_dir() and not p.name.startswith("."))
        found = ", ".join(have) or "nothing"
        raise _missing(dataset, domain, root, f"{folder} does not exist (found: {found})")
    train_dir, test_dir = folder / "train", folder / "test"
    split_given = train_dir.is_dir() or test_dir.is_dir()
    if split_given:
        for part in (train_dir, test_dir):
            if not part.is_dir():
                raise _missing(dataset, domain, root, f"{part} is missing ({folder} has a "
                               f"{'train' if part is test_dir else 'test'} folder, so both are needed)")
        train_ds = _open_folder(dataset, domain, train_dir, root)
        test_ds = _open_folder(dataset, domain, test_dir, root)
        if train_ds.classes != test_ds.classes:
            raise DataError("data.data_dir", f"{dataset} domain {domain!r}: {train_dir} and {test_dir} "
                            f"hold different classes ({_diff(train_ds.classes, test_ds.classes)})")
        classes = list(train_ds.classes)
        samples = [*train_ds.samples, *test_ds.samples]
    else:
        ds = _open_folder(dataset, domain, folder, root)
        classes = list(ds.classes)
        samples = list(ds.samples)

    cache = _cache_path(folder, size)
    key = _fingerprint(folder, samples, classes, size)
    hit = _read_cache(cache, key)
    if hit is not None:
        return hit
    if split_given:
        train_x, train_y = _decode(dataset, train_ds.samples, size)
        test_x, test_y = _decode(dataset, test_ds.samples, size)
    else:
        x, y = _decode(dataset, samples, size)
        test = fixed_test_share(y, domain)
        keep = np.ones(len(y), dtype=bool)
        keep[test] = False
        train_x, train_y, test_x, test_y = x[keep], y[keep], x[test], y[test]
    split = DomainSplit(canonical(train_x, np.uint8), canonical(train_y, np.int64),
                        canonical(test_x, np.uint8), canonical(test_y, np.int64))
    _write_cache(cache, key, classes, split)
    return classes, split


def _diff(a: list[str], b: list[str]) -> str:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    parts = []
    if only_a:
        parts.append(f"only in the first: {', '.join(only_a[:10])}{' ...' if len(only_a) > 10 else ''}")
    if only_b:
        parts.append(f"only in the second: {', '.join(only_b[:10])}{' ...' if len(only_b) > 10 else ''}")
    return "; ".join(parts) or "same names"


def load_imagefolder_domains(cfg: DataConfig) -> DomainDataset:
    """Read the run's domains of ``cfg.dataset`` from ``<data_dir>/<dataset>/<domain>/...``."""
    if cfg.dataset not in IMAGEFOLDER_DATASETS:
        raise DataError("data.dataset", f"{cfg.dataset} is not an ImageFolder dataset; those are "
                        f"{', '.join(IMAGEFOLDER_DATASETS)}")
    root = resolve_root(cfg)
    size = cfg.image_size or DEFAULT_IMAGE_SIZE
    domains: dict[str, DomainSplit] = {}
    classes: list[str] | None = None
    first = ""
    for name in cfg.all_domains():
        got, split = load_imagefolder_domain(cfg.dataset, name, root, size)
        if classes is None:
            classes, first = got, name
        elif got != classes:
            raise DataError("data.data_dir", f"{cfg.dataset}: domains {first!r} and {name!r} hold different "
                            f"class folders ({_diff(classes, got)}); every domain needs the same classes")
        domains[name] = split
    assert classes is not None  # config validation guarantees at least one domain
    mean, std = channel_stats([domains[d].train_x for d in cfg.client_domains()])
    return DomainDataset(cfg.dataset, domains, len(classes), mean, std, classes=tuple(classes))
