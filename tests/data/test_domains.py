"""``fmnist_domains`` on the real Fashion-MNIST: fixed shares, exact transforms, domain partitions and
the server's domain."""

import numpy as np
import pytest

from fedray.config import DataConfig

from fedray.load import load_config
from fedray.data import (
    FMNIST_DOMAINS,
    build_federated_data,
    fmnist_domain_shares,
    load_dataset,
    partition_summary,
)

pytestmark = pytest.mark.realdata


def data_cfg(root, **kw):
    base = {"data.dataset": "fmnist_domains", "data.data_dir": str(root)}
    return load_config(None, {**base, **{"data." + k.replace("__", "."): v for k, v in kw.items()}}).data


@pytest.fixture(scope="module")
def raw(fashion_mnist_root):
    return load_dataset(DataConfig(dataset="fashion_mnist", data_dir=str(fashion_mnist_root)), 0)


@pytest.fixture(scope="module")
def shares(raw):
    return fmnist_domain_shares(raw.train_y, 0), fmnist_domain_shares(raw.test_y, 1)


@pytest.fixture(scope="module")
def silo(fashion_mnist_root):
    """Cross-silo, all five domains, no server data: client k = domain k."""
    return build_federated_data(data_cfg(fashion_mnist_root, partition="domain"), seed=0)


def block(fd, name, split="train"):
    d = fd.domains.index(name)
    x, y, dom = ((fd.train_x, fd.train_y, fd.train_domain) if split == "train"
                 else (fd.test_x, fd.test_y, fd.test_domain))
    return x[dom == d], y[dom == d]


def test_shares_are_fixed_disjoint_and_class_balanced(raw, shares):
    train, test = shares
    for parts, labels, n in ((train, raw.train_y, 60000), (test, raw.test_y, 10000)):
        assert len(parts) == 5
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))  # disjoint, complete
        for p in parts:
            np.testing.assert_array_equal(np.bincount(labels[p], minlength=10), [n // 50] * 10)
    again = fmnist_domain_shares(raw.train_y, 0)
    assert all(np.array_equal(a, b) for a, b in zip(again, train))


def test_cross_silo_one_client_per_domain(silo):
    fd = silo
    assert fd.dataset == "fmnist_domains" and fd.domains == FMNIST_DOMAINS
    assert fd.num_clients == 5 and fd.num_classes == 10 and fd.input_shape == (1, 28, 28)
    assert fd.train_x.shape == (60000, 1, 28, 28) and fd.train_x.dtype == np.uint8
    assert fd.test_x.shape == (10000, 1, 28, 28) and fd.server is None
    np.testing.assert_array_equal(fd.client_domain, np.arange(5))
    np.testing.assert_array_equal(np.bincount(fd.test_domain), [2000] * 5)
    for k in range(5):
        idx = np.concatenate([fd.client_train[k], fd.client_test[k]])
        np.testing.assert_array_equal(np.sort(idx), np.flatnonzero(fd.train_domain == k))
        assert len(fd.client_test[k]) == 2400  # the usual 80/20 split of the domain's 12,000
    assert [r["domain"] for r in partition_summary(fd)] == list(FMNIST_DOMAINS)
    # Measured on the transformed images: inversion and blur move the statistics off Fashion-MNIST's.
    assert 0.3 < fd.mean[0] < 0.5 and 0.3 < fd.std[0] < 0.45


def test_each_domain_is_its_share_under_its_transform(silo, raw, shares):
    fd = silo
    train, test = shares
    src = {n: raw.train_x[train[i]] for i, n in enumerate(FMNIST_DOMAINS)}
    for i, name in enumerate(FMNIST_DOMAINS):
        _, y = block(fd, name)
        np.testing.assert_array_equal(y, raw.train_y[train[i]])

    x, _ = block(fd, "original")
    np.testing.assert_array_equal(x, src["original"])
    x, _ = block(fd, "inverted")
    np.testing.assert_array_equal(x.astype(int), 255 - src["inverted"].astype(int))
    tx, _ = block(fd, "inverted", "test")
    np.testing.assert_array_equal(tx, 255 - raw.test_x[test[2]])
    x, _ = block(fd, "rotated")  # 90 degrees counter-clockwise: out[u, v] = x[v, 27 - u]
    s = src["rotated"]
    for u, v in ((0, 0), (3, 20), (27, 5), (14, 14)):
        np.testing.assert_array_equal(x[:, 0, u, v], s[:, 0, v, 27 - u])

    x, _ = block(fd, "noisy")  # clip(rint(x + 40 z)), z from the documented fixed stream
    z = np.random.default_rng([0x5EED, 0]).standard_normal(x.shape, dtype=np.float32)
    expect = np.clip(np.rint(src["noisy"].astype(np.float32) + np.float32(40.0) * z), 0, 255)
    np.testing.assert_array_equal(x, expect.astype(np.uint8))
    diff = x.astype(float) - src["noisy"]
    mid = (src["noisy"] > 60) & (src["noisy"] < 195)  # away from clipping: the full noise shows
    assert abs(diff[mid].mean()) < 1 and 38 < diff[mid].std() < 42

    x, _ = block(fd, "blurred")  # 64 + 0.5 * gaussian_blur(sigma=1), by an independent convolution
    assert x.min() >= 64 and x.max() <= 192
    r = np.arange(-4, 5)
    kern = np.exp(-0.5 * r**2)
    kern /= kern.sum()
    imgs = np.pad(src["blurred"][:3, 0].astype(np.float64), ((0, 0), (4, 4), (4, 4)), mode="edge")
    rows_ = sum(kern[i] * imgs[:, i : i + 28, :] for i in range(9))
    blur = sum(kern[i] * rows_[:, :, i : i + 28] for i in range(9))
    assert np.abs(x[:3, 0].astype(float) - (64 + 0.5 * blur)).max() <= 1.0


def test_server_domain_is_unlabelled_and_nowhere_else(fashion_mnist_root, raw, shares):
    cfg = data_cfg(fashion_mnist_root, partition="domain", server_data__kind="domain")
    assert cfg.num_clients == 4  # set by the config for the cross-silo partition
    fd = build_federated_data(cfg, seed=0)
    s = fd.server
    assert s.domain == "blurred" and not s.labelled and s.visible_y() is None
    assert s.x.shape == (12000, 1, 28, 28)
    np.testing.assert_array_equal(s.y, raw.train_y[shares[0][4]])
    b = FMNIST_DOMAINS.index("blurred")
    assert fd.num_clients == 4 and b not in fd.client_domain
    assert b not in fd.train_domain and b not in fd.test_domain
    assert fd.train_x.shape[0] == 48000 and fd.test_x.shape[0] == 8000
    assert not {r.tobytes() for r in s.x[:200]} & {r.tobytes() for r in fd.train_x}


def test_cross_device_subset_of_domains(fashion_mnist_root, raw, shares):
    cfg = data_cfg(fashion_mnist_root, domains=["original", "inverted", "noisy"],
                   partition="domain_dirichlet", clients_per_domain=2, alpha=0.5, server_data__kind="domain")
    fd = build_federated_data(cfg, seed=3)
    assert fd.domains == ("original", "inverted", "noisy") and fd.server.domain == "noisy"
    assert fd.num_clients == 4
    np.testing.assert_array_equal(fd.client_domain, [0, 0, 1, 1])  # domain-major, each single-domain
    for k in range(4):
        idx = np.concatenate([fd.client_train[k], fd.client_test[k]])
        assert (fd.train_domain[idx] == k // 2).all()
    # A domain is the same images whichever domains a run selects.
    x, _ = block(fd, "inverted")
    np.testing.assert_array_equal(x, 255 - raw.train_x[shares[0][2]])
    assert fd.server.x.shape[0] == 12000 and set(np.unique(fd.test_domain)) == {0, 1}
