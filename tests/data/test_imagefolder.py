"""ImageFolder datasets (digit5 here) on tiny fabricated PNG trees in the documented layout."""

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedray.load import load_config
from fedray.data import build_federated_data, load_domains, partition_summary, plot_partition
from fedray.errors import DataError

CLASSES = ("0", "1", "2")


def grey_value(c: int, i: int) -> int:
    return 10 * c + i + 1


def svhn_rgb(c: int, i: int, split: str) -> tuple[int, int, int]:
    return 50 * c, 10 * i + (5 if split == "test" else 0), 200


def write_png(path: Path, img: Image.Image) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def fabricate(root: Path) -> Path:
    """digit5/mnist: no split, 4 grey 20x24 images per class (one a palette image, one with alpha);
    digit5/svhn: train/ (3 per class) and test/ (2 per class), RGB 40x40. Every image is one flat colour,
    so resizing keeps it and a pixel tells which image it was."""
    base = root / "digit5"
    for c, cls in enumerate(CLASSES):
        for i in range(4):
            img = Image.new("L", (20, 24), grey_value(c, i))
            if i == 2:
                img = img.convert("P")
            elif i == 3:
                img = img.convert("LA")
            write_png(base / "mnist" / cls / f"img{i}.png", img)
        for split, n in (("train", 3), ("test", 2)):
            for i in range(n):
                img = Image.new("RGB", (40, 40), svhn_rgb(c, i, split))
                write_png(base / "svhn" / split / cls / f"s{i}.png", img)
    return root


@pytest.fixture
def root(tmp_path):
    return fabricate(tmp_path / "data")


def data_cfg(root, **kw):
    base = {"data.dataset": "digit5", "data.data_dir": str(root), "data.domains": ["mnist", "svhn"],
            "data.image_size": 8, "data.partition": "domain", "federation.clients_per_round": 2}
    return load_config(None, {**base, **{"data." + k.replace("__", "."): v for k, v in kw.items()}}).data


def test_load_shapes_labels_splits_rgb_and_resize(root):
    md = load_domains(data_cfg(root))
    assert list(md.domains) == ["mnist", "svhn"] and md.num_classes == 3 and md.classes == CLASSES
    m, s = md.domains["mnist"], md.domains["svhn"]
    # mnist has no split: a fixed 20% of each class (round(0.2 * 4) = 1) is its test share.
    assert m.train_x.shape == (9, 3, 8, 8) and m.test_x.shape == (3, 3, 8, 8)
    np.testing.assert_array_equal(np.bincount(m.train_y), [3, 3, 3])
    np.testing.assert_array_equal(np.bincount(m.test_y), [1, 1, 1])
    for x, y in ((m.train_x, m.train_y), (m.test_x, m.test_y)):
        assert x.dtype == np.uint8 and y.dtype == np.int64 and x.flags.c_contiguous
        assert (x == x[:, :1, :1, :1]).all()  # flat images, three equal channels (grey -> RGB)
        v = x[:, 0, 0, 0].astype(int)
        np.testing.assert_array_equal((v - 1) // 10, y)  # the pixel value encodes the class folder
    seen = sorted(np.concatenate([m.train_x, m.test_x])[:, 0, 0, 0].tolist())
    assert seen == sorted(grey_value(c, i) for c in range(3) for i in range(4))  # every image once
    # svhn keeps its own train/test folders.
    assert s.train_x.shape == (9, 3, 8, 8) and s.test_x.shape == (6, 3, 8, 8)
    for x, y, split in ((s.train_x, s.train_y, "train"), (s.test_x, s.test_y, "test")):
        got = {tuple(int(v) for v in img[:, 3, 3]) for img in x}
        n = 3 if split == "train" else 2
        assert got == {svhn_rgb(c, i, split) for c in range(3) for i in range(n)}
        np.testing.assert_array_equal(x[:, 0, 0, 0] // 50, y)


def test_default_image_size_is_32(root):
    md = load_domains(data_cfg(root, image_size=None))
    assert md.domains["svhn"].train_x.shape == (9, 3, 32, 32)


def test_federated_cross_silo_and_global_test(root):
    fd = build_federated_data(data_cfg(root), seed=0)
    assert fd.dataset == "digit5" and fd.domains == ("mnist", "svhn") and fd.num_clients == 2
    assert fd.train_x.shape == (18, 3, 8, 8) and fd.test_x.shape == (9, 3, 8, 8)
    np.testing.assert_array_equal(fd.train_domain, [0] * 9 + [1] * 9)
    np.testing.assert_array_equal(fd.test_domain, [0] * 3 + [1] * 6)
    np.testing.assert_array_equal(fd.client_domain, [0, 1])
    assert [len(t) for t in fd.client_test] == [2, 2] and [len(t) for t in fd.client_train] == [7, 7]
    assert [r["domain"] for r in partition_summary(fd)] == ["mnist", "svhn"]
    assert len(fd.mean) == len(fd.std) == 3
    # The domain's test share is fixed: another run seed moves the clients' splits, not the domain's.
    other = build_federated_data(data_cfg(root), seed=5)
    np.testing.assert_array_equal(other.test_x, fd.test_x)
    np.testing.assert_array_equal(other.train_x, fd.train_x)
    again = build_federated_data(data_cfg(root), seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(again.client_train, fd.client_train))


def test_server_domain_and_label_partitions_on_domains(root, tmp_path):
    fd = build_federated_data(data_cfg(root, partition="iid", num_clients=2, server_data__kind="domain"), 0)
    assert fd.server.domain == "svhn" and not fd.server.labelled and fd.server.x.shape == (9, 3, 8, 8)
    assert fd.train_x.shape[0] == 9 and (fd.train_domain == 0).all() and (fd.test_domain == 0).all()
    np.testing.assert_array_equal(fd.client_domain, [0, 0])
    assert plot_partition(fd, tmp_path / "server.png").stat().st_size > 5000

    fd = build_federated_data(data_cfg(root, partition="iid", num_clients=2, server_data__kind="holdout",
                                       server_data__per_class=1), 0)
    assert fd.server.labelled and len(fd.server) == 3 and fd.train_x.shape[0] == 15
    assert len(fd.train_domain) == 15
    summary = partition_summary(fd)
    assert all(r["domain"] in ("mnist", "svhn", "mixed") for r in summary)
    assert plot_partition(fd, tmp_path / "mixed.png").stat().st_size > 5000


def test_too_many_clients_per_domain_names_the_key(root):
    with pytest.raises(DataError) as e:
        cfg = data_cfg(root, partition="domain_dirichlet", clients_per_domain=20, min_samples=2)
        build_federated_data(cfg, 0)
    assert e.value.key == "data.clients_per_domain" and "'mnist'" in e.value.message


def test_cache_is_used_and_invalidated(root):
    cfg = data_cfg(root)
    first = load_domains(cfg).domains["mnist"]
    assert (root / "digit5" / "mnist" / ".fedray-cache-8px.npz").is_file()
    cached = load_domains(cfg).domains["mnist"]
    np.testing.assert_array_equal(cached.train_x, first.train_x)
    np.testing.assert_array_equal(cached.test_y, first.test_y)
    # Editing an image rebuilds the domain.
    path = root / "digit5" / "mnist" / "1" / "img0.png"
    Image.new("L", (20, 24), 250).save(path)
    os.utime(path, ns=(1, 1))
    fresh = load_domains(cfg).domains["mnist"]
    assert 250 in np.concatenate([fresh.train_x, fresh.test_x])[:, 0, 0, 0]


def test_missing_domain_names_data_dir_and_the_path(root):
    with pytest.raises(DataError) as e:
        load_domains(data_cfg(root, domains=["mnist", "usps"]))
    assert e.value.key == "data.data_dir"
    msg = e.value.message
    assert "digit5 domain 'usps' not found" in msg and str(root / "digit5" / "usps") in msg
    assert "--data-dir" in msg and "never downloaded" in msg and "found: mnist, svhn" in msg


def test_missing_dataset_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = load_config(None, {"data.dataset": "office_caltech10", "data.data_dir": str(tmp_path / "empty")})
    cfg = cfg.data
    with pytest.raises(DataError) as e:
        build_federated_data(cfg, 0)
    assert e.value.key == "data.data_dir" and str(tmp_path / "empty" / "office_caltech10") in e.value.message


def test_classes_must_match_across_domains(root):
    write_png(root / "digit5" / "mnist" / "9" / "x.png", Image.new("L", (8, 8), 3))
    with pytest.raises(DataError) as e:
        load_domains(data_cfg(root))
    assert e.value.key == "data.data_dir" and "different class" in e.value.message and "9" in e.value.message


def test_half_a_split_is_an_error(root):
    import shutil

    shutil.rmtree(root / "digit5" / "svhn" / "test")
    with pytest.raises(DataError, match="test is missing"):
        load_domains(data_cfg(root))


def test_a_domain_without_images_is_an_error(root):
    (root / "digit5" / "syn" / "0").mkdir(parents=True)
    with pytest.raises(DataError) as e:
        load_domains(data_cfg(root, domains=["mnist", "syn"]))
    assert e.value.key == "data.data_dir" and "syn" in e.value.message
