"""Loaders, on tiny files written in the real formats and torchvision's layout (no network, ever)."""

import gzip
import pickle
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import scipy.io
import torch
from torchvision import datasets as tvd

from fedray.config import DataConfig
from fedray.data.datasets import DEBIAN_FASHION_MNIST_ENV, resolve_root
from fedray.data.loading import load_dataset
from fedray.data.synthetic import make_synthetic
from fedray.errors import DataError

UPRIGHT = np.arange(28 * 28, dtype=np.uint8).reshape(28, 28)  # asymmetric: [0, 1] = 1 but [1, 0] = 28


def write_idx(path: Path, arr: np.ndarray, gz: bool = False) -> None:
    """The IDX format of (E)MNIST: magic 0x0000 08 ndim, big-endian int32 dims, then uint8 data."""
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(header + arr.tobytes())


def images(n: int, offset: int = 0) -> np.ndarray:
    return np.stack([(UPRIGHT.astype(int) + i + offset) % 256 for i in range(n)]).astype(np.uint8)


def write_mnist_like(folder: Path, n_train=20, n_test=10, gz=False, names=None, labels=None):
    """``names`` maps (split, kind) to a file stem; default is MNIST's train-/t10k- names."""
    names = names or {(s, k): f"{p}-{k}" for s, p in (("train", "train"), ("test", "t10k"))
                      for k in ("images-idx3-ubyte", "labels-idx1-ubyte")}
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("test", n_test)):
        y = labels(n) if labels else np.arange(n) % 10
        x = images(n, 100 if split == "test" else 0)
        write_idx(folder / (names[split, "images-idx3-ubyte"] + suffix), x, gz)
        write_idx(folder / (names[split, "labels-idx1-ubyte"] + suffix), y, gz)


def cfg(root, **kw) -> DataConfig:
    return DataConfig(data_dir=str(root), download=False, **kw)


@pytest.fixture
def no_md5(monkeypatch):
    """torchvision checks CIFAR/SVHN files against the md5 of the real downloads, which tiny test files
    cannot match. Patch only the checksum lists (None = "just check the file exists") in this test;
    the loading code under test is torchvision's own, unchanged."""
    for cls in (tvd.CIFAR10, tvd.CIFAR100):
        monkeypatch.setattr(cls, "train_list", [[f, None] for f, _ in cls.train_list])
        monkeypatch.setattr(cls, "test_list", [[f, None] for f, _ in cls.test_list])
        monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": None})
    monkeypatch.setattr(tvd.SVHN, "split_list", {k: [u, f, None] for k, (u, f, _) in tvd.SVHN.split_list.items()})


def _check_common(raw, n_train, n_test, shape):
    assert raw.train_x.shape == (n_train, *shape) and raw.test_x.shape == (n_test, *shape)
    for a in (raw.train_x, raw.test_x):
        assert a.dtype == np.uint8 and a.flags.c_contiguous
    assert raw.train_y.dtype == raw.test_y.dtype == np.int64
    assert raw.train_y.shape == (n_train,) and raw.test_y.shape == (n_test,)
    assert len(raw.mean) == len(raw.std) == shape[0]


@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_family(isolated_env, name, folder):
    write_mnist_like(isolated_env / "root" / folder / "raw")
    raw = load_dataset(cfg(isolated_env / "root", dataset=name), 0)
    _check_common(raw, 20, 10, (1, 28, 28))
    assert raw.num_classes == 10
    np.testing.assert_array_equal(raw.train_x[:, 0], images(20))  # stored upright: no transpose
    np.testing.assert_array_equal(raw.test_y, np.arange(10) % 10)


@pytest.mark.parametrize("split,classes", [("balanced", 47), ("letters", 26), ("digits", 10)])
def test_emnist_is_transposed_upright_and_letters_start_at_zero(isolated_env, split, classes):
    names = {(s, k): f"emnist-{split}-{s}-{k}" for s in ("train", "test")
             for k in ("images-idx3-ubyte", "labels-idx1-ubyte")}
    labels = (lambda n: np.arange(n) % 26 + 1) if split == "letters" else (lambda n: np.arange(n) % classes)
    raw_dir = isolated_env / "root" / "EMNIST" / "raw"
    write_mnist_like(raw_dir, names=names, labels=labels)
    # EMNIST's files hold each image transposed: write the transposes, expect the upright images back.
    for s, n, off in (("train", 20, 0), ("test", 10, 100)):
        write_idx(raw_dir / names[s, "images-idx3-ubyte"], images(n, off).transpose(0, 2, 1))
    raw = load_dataset(cfg(isolated_env / "root", dataset="emnist", emnist_split=split), 0)
    _check_common(raw, 20, 10, (1, 28, 28))
    np.testing.assert_array_equal(raw.train_x[:, 0], images(20))
    np.testing.assert_array_equal(raw.test_x[:, 0], images(10, 100))
    assert raw.num_classes == classes
    assert raw.train_y.min() == 0 and raw.train_y.max() < classes


def _cifar_rows(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8)


def _pickle(path: Path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def test_cifar10_python_batches(isolated_env, no_md5):
    folder = isolated_env / "root" / "cifar-10-batches-py"
    rows = []
    for i in range(1, 6):
        r = _cifar_rows(3, i)
        rows.append(r)
        _pickle(folder / f"data_batch_{i}", {"data": r, "labels": [(i + j) % 10 for j in range(3)]})
    test_rows = _cifar_rows(4, 9)
    _pickle(folder / "test_batch", {"data": test_rows, "labels": [9, 8, 7, 6]})
    _pickle(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})
    raw = load_dataset(cfg(isolated_env / "root", dataset="cifar10"), 0)
    _check_common(raw, 15, 4, (3, 32, 32))
    assert raw.num_classes == 10
    # CIFAR rows are channel-major (R plane, G plane, B plane): NCHW is a plain reshape of the rows.
    np.testing.assert_array_equal(raw.train_x, np.concatenate(rows).reshape(15, 3, 32, 32))
    np.testing.assert_array_equal(raw.test_x, test_rows.reshape(4, 3, 32, 32))
    np.testing.assert_array_equal(raw.test_y, [9, 8, 7, 6])


def test_cifar100_fine_labels(isolated_env, no_md5):
    folder = isolated_env / "root" / "cifar-100-python"
    train_rows, test_rows = _cifar_rows(6, 1), _cifar_rows(2, 2)
    _pickle(folder / "train", {"data": train_rows, "fine_labels": [0, 99, 5, 6, 7, 8], "coarse_labels": [0] * 6})
    _pickle(folder / "test", {"data": test_rows, "fine_labels": [42, 1], "coarse_labels": [0] * 2})
    _pickle(folder / "meta", {"fine_label_names": [f"c{i}" for i in range(100)]})
    raw = load_dataset(cfg(isolated_env / "root", dataset="cifar100"), 0)
    _check_common(raw, 6, 2, (3, 32, 32))
    assert raw.num_classes == 100
    np.testing.assert_array_equal(raw.train_y, [0, 99, 5, 6, 7, 8])
    np.testing.assert_array_equal(raw.test_x, test_rows.reshape(2, 3, 32, 32))


def test_svhn_mat_files(isolated_env, no_md5):
    root = isolated_env / "root"
    root.mkdir()
    xs = {}
    for split, n in (("train", 7), ("test", 3)):
        X = np.random.default_rng(n).integers(0, 256, (32, 32, 3, n), dtype=np.uint8)  # SVHN: H, W, C, N
        y = (np.arange(n) % 10 + 1).reshape(n, 1).astype(np.uint8)  # SVHN labels digit 0 as 10
        scipy.io.savemat(root / f"{split}_32x32.mat", {"X": X, "y": y})
        xs[split] = X
    raw = load_dataset(cfg(root, dataset="svhn"), 0)
    _check_common(raw, 7, 3, (3, 32, 32))
    assert raw.num_classes == 10
    np.testing.assert_array_equal(raw.train_y, [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(raw.test_y, [1, 2, 3])
    np.testing.assert_array_equal(raw.train_x, xs["train"].transpose(3, 2, 0, 1))
    svhn10 = np.full((10, 1), 10, dtype=np.uint8)
    scipy.io.savemat(root / "test_32x32.mat", {"X": np.zeros((32, 32, 3, 10), np.uint8), "y": svhn10})
    assert (load_dataset(cfg(root, dataset="svhn"), 0).test_y == 0).all()  # label 10 means digit 0


@pytest.mark.parametrize("name", ["fashion_mnist", "mnist", "emnist", "svhn", "cifar10", "cifar100"])
def test_missing_dataset_without_download_is_one_clear_error(isolated_env, name):
    (isolated_env / "empty").mkdir()
    with pytest.raises(DataError) as e:
        load_dataset(cfg(isolated_env / "empty", dataset=name), 0)
    assert e.value.key == "data.dataset"
    msg = e.value.message
    assert f"{name} not found under" in msg and "data.download is false" in msg and "--data-dir" in msg
    assert "\n" not in msg


def test_failed_download_is_one_clear_error(isolated_env, monkeypatch):
    # Stand in for the network: torchvision's downloader raises what urllib raises offline.
    def offline(*a, **k):
        raise URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(tvd.mnist, "download_and_extract_archive", offline)
    (isolated_env / "empty").mkdir()
    with pytest.raises(DataError) as e:
        load_dataset(DataConfig(data_dir=str(isolated_env / "empty"), dataset="mnist", download=True), 0)
    assert e.value.key == "data.dataset"
    assert "download failed" in e.value.message and "Name or service not known" in e.value.message
    assert "\n" not in e.value.message


def test_corrupt_file_is_a_data_error(isolated_env):
    raw_dir = isolated_env / "root" / "MNIST" / "raw"
    write_mnist_like(raw_dir)
    (raw_dir / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + b"\x00" * 7)
    with pytest.raises(DataError) as e:
        load_dataset(cfg(isolated_env / "root", dataset="mnist"), 0)
    assert e.value.key == "data.dataset" and "could not be read" in e.value.message


def test_data_dir_must_exist(tmp_path):
    with pytest.raises(DataError) as e:
        resolve_root(DataConfig(data_dir=str(tmp_path / "nope")))
    assert e.value.key == "data.data_dir" and "--data-dir" in e.value.message


def test_default_root_comes_from_env_and_is_created(isolated_env):
    root = resolve_root(DataConfig())
    assert root == isolated_env / "default-root" and root.is_dir()


# ---------------------------------------------------------------------------------------------------
# Debian's dataset-fashion-mnist


def _fake_debian(folder: Path) -> Path:
    write_mnist_like(folder, n_train=12, n_test=6, gz=True)
    return folder


def test_debian_copy_is_found_and_decompressed_into_torchvision_layout(isolated_env, monkeypatch):
    monkeypatch.setenv(DEBIAN_FASHION_MNIST_ENV, str(_fake_debian(isolated_env / "debian")))
    root = isolated_env / "root"
    root.mkdir()
    raw = load_dataset(cfg(root, dataset="fashion_mnist"), 0)
    _check_common(raw, 12, 6, (1, 28, 28))
    np.testing.assert_array_equal(raw.train_x[:, 0], images(12))
    files = sorted(p.name for p in (root / "FashionMNIST" / "raw").iterdir())
    assert files == sorted(["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                            "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"])  # no temp leftovers


def test_debian_copy_fills_only_missing_files_and_never_overwrites(isolated_env, monkeypatch):
    monkeypatch.setenv(DEBIAN_FASHION_MNIST_ENV, str(_fake_debian(isolated_env / "debian")))
    raw_dir = isolated_env / "root" / "FashionMNIST" / "raw"
    write_mnist_like(raw_dir, n_train=12, n_test=6)
    write_idx(raw_dir / "t10k-labels-idx1-ubyte", np.full(6, 3))  # a user's own copy
    (raw_dir / "train-images-idx3-ubyte").unlink()
    raw = load_dataset(cfg(isolated_env / "root", dataset="fashion_mnist"), 0)
    assert (raw.test_y == 3).all()
    np.testing.assert_array_equal(raw.train_x[:, 0], images(12))


def test_interrupted_debian_copy_never_looks_complete(isolated_env, monkeypatch):
    debian = _fake_debian(isolated_env / "debian")
    gz = (debian / "train-images-idx3-ubyte.gz").read_bytes()
    (debian / "train-images-idx3-ubyte.gz").write_bytes(gz[: len(gz) // 2])  # truncated stream
    monkeypatch.setenv(DEBIAN_FASHION_MNIST_ENV, str(debian))
    (isolated_env / "root").mkdir()
    with pytest.raises(DataError) as e:
        load_dataset(cfg(isolated_env / "root", dataset="fashion_mnist"), 0)
    assert e.value.key == "data.data_dir"
    raw_dir = isolated_env / "root" / "FashionMNIST" / "raw"
    assert not (raw_dir / "train-images-idx3-ubyte").exists()
    assert not [p for p in raw_dir.iterdir() if p.name.endswith(".part")]


def test_no_debian_copy_mentions_the_package(isolated_env):
    (isolated_env / "root").mkdir()
    with pytest.raises(DataError) as e:
        load_dataset(cfg(isolated_env / "root", dataset="fashion_mnist"), 0)
    assert "dataset-fashion-mnist" in e.value.message


@pytest.mark.realdata
def test_real_fashion_mnist(fashion_mnist_root):
    c = DataConfig(data_dir=str(fashion_mnist_root), dataset="fashion_mnist", download=False)
    raw = load_dataset(c, 0)
    _check_common(raw, 60000, 10000, (1, 28, 28))
    assert raw.num_classes == 10
    np.testing.assert_array_equal(np.bincount(raw.train_y), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(raw.test_y), [1000] * 10)
    assert abs(raw.train_x.mean() / 255 - raw.mean[0]) < 1e-3  # published statistics match the data


# ---------------------------------------------------------------------------------------------------
# synthetic


def test_synthetic_deterministic_shapes_and_balanced():
    a = make_synthetic(1000, 200, 10, 3, 16, seed=5)
    b = make_synthetic(1000, 200, 10, 3, 16, seed=5)
    c = make_synthetic(1000, 200, 10, 3, 16, seed=6)
    _check_common(a, 1000, 200, (3, 16, 16))
    for f in ("train_x", "train_y", "test_x", "test_y"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert not np.array_equal(a.train_x, c.train_x)
    np.testing.assert_array_equal(np.bincount(a.train_y), [100] * 10)
    assert a.num_classes == 10 and a.name == "synthetic"
    assert all(0.2 < s < 0.5 for s in a.std) and all(0.35 < m < 0.65 for m in a.mean)


def test_synthetic_default_size_follows_num_clients():
    raw = load_dataset(DataConfig(dataset="synthetic", num_clients=50, synthetic_test_samples=20), 0)
    assert len(raw.train_y) == 3000 and len(raw.test_y) == 20  # max(2000, 60 * 50)
    assert raw.train_x.shape[1:] == (1, 16, 16)


def test_synthetic_is_learnable_but_not_trivial():
    raw = make_synthetic(2000, 1000, 10, 1, 16, seed=0)
    m, s = raw.mean[0], raw.std[0]
    x = (torch.from_numpy(raw.train_x).float().flatten(1) / 255 - m) / s
    xt = (torch.from_numpy(raw.test_x).float().flatten(1) / 255 - m) / s
    y, yt = torch.from_numpy(raw.train_y), torch.from_numpy(raw.test_y)
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 10)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    accs = []
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            accs.append((model(xt).argmax(1) == yt).float().mean().item())
    assert accs[-1] > 0.8
    assert accs[0] < 0.9  # one step does not solve it


def test_synthetic_knobs_set_how_far_the_label_is_read_off_the_image():
    """noise, shift and contrast: without noise or shift every image IS its class template (a nearest-template
    reader is exact); the noise's std is the pixels' spread around it; more contrast puts the templates further
    apart; the defaults are today's dataset, bit for bit."""
    clean = make_synthetic(200, 50, 10, 1, 16, seed=3, noise=0.0, shift=0)
    templates = np.stack([clean.train_x[clean.train_y == c][0] for c in range(10)]).astype(np.float64)
    for x, y in ((clean.train_x, clean.train_y), (clean.test_x, clean.test_y)):
        assert (x[:, None].astype(np.float64) == templates[None]).reshape(len(x), 10, -1).all(2).argmax(1).tolist() \
            == y.tolist()
    noisy = make_synthetic(200, 50, 10, 1, 16, seed=3, noise=0.1, shift=0)
    spread = (noisy.train_x.astype(np.float64) - templates[noisy.train_y]) / 255
    assert 0.08 < spread.std() < 0.11  # clipping at 0 and 1 trims a little
    far = make_synthetic(200, 50, 10, 1, 16, seed=3, noise=0.0, shift=0, contrast=0.4)
    assert far.train_x.astype(np.float64).std() > 1.5 * clean.train_x.astype(np.float64).std()
    shifted = make_synthetic(200, 50, 10, 1, 16, seed=3, noise=0.0, shift=2)
    assert len({x.tobytes() for x in shifted.train_x[shifted.train_y == 0]}) > 1  # the template moves
    default = make_synthetic(300, 50, 10, 1, 16, seed=3)
    explicit = make_synthetic(300, 50, 10, 1, 16, seed=3, noise=0.3, shift=2, contrast=0.22)
    np.testing.assert_array_equal(default.train_x, explicit.train_x)
    cfg = DataConfig(dataset="synthetic", synthetic_noise=0.0, synthetic_shift=0, synthetic_test_samples=20)
    np.testing.assert_array_equal(load_dataset(cfg, 3).train_x[:5], make_synthetic(
        2000, 20, 10, 1, 16, seed=3, noise=0.0, shift=0).train_x[:5])
