import numpy as np
import pytest
import torch

from fedray.config import DataConfig
from fedray.data import FederatedData, build_federated_data, partition_summary, plot_partition, to_float
from fedray.errors import DataError


def synth(**kw) -> DataConfig:
    base = dict(dataset="synthetic", num_clients=20, alpha=0.5, synthetic_train_samples=2000,
                synthetic_test_samples=200)
    return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def fd() -> FederatedData:
    return build_federated_data(synth(), seed=3)


def test_end_to_end_on_synthetic(fd):
    assert fd.num_clients == 20 and fd.input_shape == (1, 16, 16) and fd.num_classes == 10
    assert fd.train_x.shape == (2000, 1, 16, 16) and fd.test_x.shape == (200, 1, 16, 16)
    everything = np.concatenate(fd.client_train + fd.client_test)
    np.testing.assert_array_equal(np.sort(everything), np.arange(2000))  # Dirichlet: every sample once
    for tr, te in zip(fd.client_train, fd.client_test):
        assert tr.dtype == te.dtype == np.int64
        assert not np.intersect1d(tr, te).size
        n = len(tr) + len(te)
        assert len(te) == min(max(round(0.2 * n), 1), n - 1)
        assert n >= 10  # data.min_samples
    sizes = fd.client_sizes()
    assert sizes.dtype == np.int64 and sizes.sum() + sum(len(t) for t in fd.client_test) == 2000


def test_same_config_and_seed_give_identical_arrays(fd):
    again = build_federated_data(synth(), seed=3)
    other = build_federated_data(synth(), seed=4)
    np.testing.assert_array_equal(again.train_x, fd.train_x)
    assert all(np.array_equal(a, b) for a, b in zip(again.client_train, fd.client_train))
    assert all(np.array_equal(a, b) for a, b in zip(again.client_test, fd.client_test))
    assert not all(np.array_equal(a, b) for a, b in zip(other.client_train, fd.client_train))


def test_label_counts(fd):
    counts = fd.label_counts()
    assert counts.shape == (20, 10)
    np.testing.assert_array_equal(counts.sum(axis=1), fd.client_sizes() + [len(t) for t in fd.client_test])
    k = 7
    idx = np.concatenate([fd.client_train[k], fd.client_test[k]])
    np.testing.assert_array_equal(counts[k], np.bincount(fd.train_y[idx], minlength=10))
    np.testing.assert_array_equal(counts.sum(axis=0), np.bincount(fd.train_y, minlength=10))


@pytest.mark.parametrize("kind,extra", [("iid", {}), ("shards", {"shards_per_client": 2})])
def test_other_partitions(kind, extra):
    fd = build_federated_data(synth(partition=kind, **extra), seed=0)
    assert fd.num_clients == 20
    if kind == "iid":
        sizes = fd.client_sizes() + [len(t) for t in fd.client_test]
        assert sizes.max() - sizes.min() <= 1
    else:
        assert (np.count_nonzero(fd.label_counts(), axis=1) <= 4).all()


def test_too_many_clients_is_a_data_error():
    with pytest.raises(DataError) as e:
        build_federated_data(synth(partition="iid", num_clients=3000, synthetic_train_samples=2000), seed=0)
    assert e.value.key == "data.num_clients"


def test_to_float_normalises_per_channel():
    x = torch.tensor([[[[0, 255]], [[51, 102]]]], dtype=torch.uint8)  # (1, 2, 1, 2)
    out = to_float(x, (0.5, 0.2), (0.5, 0.1))
    assert out.dtype == torch.float32 and out.shape == (1, 2, 1, 2)
    torch.testing.assert_close(out, torch.tensor([[[[-1.0, 1.0]], [[0.0, 2.0]]]]))
    torch.testing.assert_close(to_float(x[0], (0.5, 0.2), (0.5, 0.1)), out[0])  # a single image too
    f = torch.full((1, 1, 2, 2), 51.0)
    to_float(f, (0.0,), (1.0,))
    assert (f == 51.0).all()  # a float input is not modified in place


def test_to_float_matches_dataset_statistics(fd):
    x = to_float(torch.from_numpy(fd.train_x), fd.mean, fd.std)
    assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05


def test_plot_partition_writes_png(fd, tmp_path):
    out = plot_partition(fd, tmp_path / "sub" / "partition.png", title="alpha=0.5")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_partition_many_clients(tmp_path):
    fd = build_federated_data(synth(num_clients=150, alpha=1.0, min_samples=2, synthetic_train_samples=3000), 0)
    out = plot_partition(fd, tmp_path / "many.png")
    assert out.stat().st_size > 5000


def test_partition_summary(fd):
    rows = partition_summary(fd)
    assert len(rows) == 20
    r = rows[0]
    assert set(r) >= {"client", "train", "test", "label_counts", "dominant_label", "dominant_share"}
    assert r["train"] == len(fd.client_train[0]) and r["test"] == len(fd.client_test[0])
    assert sum(r["label_counts"]) == r["train"] + r["test"]
    assert r["dominant_share"] == max(r["label_counts"]) / sum(r["label_counts"])
    assert all(0.1 <= row["dominant_share"] <= 1.0 for row in rows)


@pytest.mark.realdata
def test_image_arrays_have_canonical_strides(fashion_mnist_root):
    """Torch reads a stride of 1 on a size-1 channel axis as channels-last and convolves differently;
    Ray's object store normalises strides, so odd ones would break local == ray equality."""
    from fedray.config import DataConfig
    from fedray.data import build_federated_data

    for cfg in (DataConfig(dataset="synthetic", num_clients=4),
                DataConfig(dataset="fashion_mnist", data_dir=str(fashion_mnist_root), num_clients=4)):
        fd = build_federated_data(cfg, seed=0)
        for a in (fd.train_x, fd.test_x):
            n, c, h, w = a.shape
            assert a.strides == (c * h * w, h * w, w, 1), (cfg.dataset, a.strides)
