import numpy as np
import pytest

from fedray.data.partition import partition_dirichlet, partition_iid, partition_shards, split_train_test
from fedray.errors import DataError


def _labels(n=6000, classes=10, seed=0):
    return np.random.default_rng(seed).integers(0, classes, n)


def _rng(seed=1):
    return np.random.default_rng(seed)


def _assert_exact_cover(parts, n):
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "indices must be sorted and unique"
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))


def _mean_max_share(parts, labels, classes=10):
    shares = [np.bincount(labels[p], minlength=classes).max() / len(p) for p in parts]
    return float(np.mean(shares))


@pytest.mark.parametrize("alpha", [0.05, 0.1, 1.0, 100.0])
def test_dirichlet_uses_every_index_once_and_honours_min_samples(alpha):
    y = _labels()
    parts = partition_dirichlet(y, 20, alpha, 10, _rng())
    assert len(parts) == 20
    _assert_exact_cover(parts, len(y))
    assert min(len(p) for p in parts) >= 10


def test_dirichlet_is_deterministic_in_the_rng():
    y = _labels()
    a = partition_dirichlet(y, 20, 0.1, 10, _rng(7))
    b = partition_dirichlet(y, 20, 0.1, 10, _rng(7))
    c = partition_dirichlet(y, 20, 0.1, 10, _rng(8))
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))


def test_smaller_alpha_is_more_heterogeneous():
    y = _labels()
    low = _mean_max_share(partition_dirichlet(y, 20, 0.05, 10, _rng()), y)
    mid = _mean_max_share(partition_dirichlet(y, 20, 1.0, 10, _rng()), y)
    high = _mean_max_share(partition_dirichlet(y, 20, 100.0, 10, _rng()), y)
    assert low > mid > high
    assert low > 0.5 and high < 0.2  # near one-label clients vs near-uniform (1/10 = 0.1)


@pytest.mark.parametrize("seed", range(4))
def test_dirichlet_caps_clients_at_n_over_k_before_each_class(seed):
    """The N/K rule of the DaFKD/FedKF code, checked exactly: classes are dealt in ascending order, and a client
    receives class c only while the samples it already holds (of the classes before c) are fewer than N/K. At
    alpha 0.05 with 20 clients and 10 classes (N/K = 100, about 200 a class), a client whose first class filled it
    would otherwise go on taking whole classes. One exception, the code's own: the last client's share is what the
    cuts leave (n_c - floor(n_c * sum of the other shares)), so when it is full float rounding of that sum can still
    hand it one sample, as in the authors' code, whose splits these are."""
    y = _labels(2000, 10, seed)
    parts = partition_dirichlet(y, 20, 0.05, 1, _rng(seed))
    cap = 2000 / 20
    counts = np.stack([np.bincount(y[p], minlength=10) for p in parts])  # (client, class)
    held_before = np.cumsum(counts, axis=1) - counts  # what each client held when each class was dealt
    over = np.where(held_before >= cap, counts, 0)  # what full clients received
    over[-1] = np.where(over[-1] == 1, 0, over[-1])  # the last client's rounding sample
    assert not over.any(), {(int(k), int(c)): int(over[k, c]) for k, c in zip(*np.nonzero(over))}
    assert (held_before[:, -1] + counts[:, -1] > cap).any()  # the rule is what binds here: some client went over


def test_dirichlet_impossible_min_samples_names_the_key():
    y = _labels(100)
    with pytest.raises(DataError) as e:
        partition_dirichlet(y, 50, 0.1, 10, _rng(), max_tries=20)
    assert e.value.key == "data.min_samples"
    assert "lower data.min_samples" in e.value.message and "alpha=0.1" in e.value.message


@pytest.mark.parametrize("fn", ["dirichlet", "iid"])
def test_more_clients_than_samples_is_a_data_error(fn):
    y = _labels(30)
    with pytest.raises(DataError) as e:
        if fn == "dirichlet":
            partition_dirichlet(y, 31, 1.0, 2, _rng())
        else:
            partition_iid(y, 31, _rng())
    assert e.value.key == "data.num_clients"


def test_dirichlet_10000_clients():
    # Its speed is benchmarks/speed/scale.py's data_build_s; here only correctness at that size.
    y = _labels(600_000, 10)
    parts = partition_dirichlet(y, 10_000, 1.0, 10, _rng())
    _assert_exact_cover(parts, len(y))
    assert min(len(p) for p in parts) >= 10


def test_iid_equal_sizes_and_cover():
    y = _labels(1003)
    parts = partition_iid(y, 10, _rng())
    _assert_exact_cover(parts, len(y))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.array_equal(p, q) for p, q in zip(parts, partition_iid(y, 10, _rng())))


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_shards_limit_labels_per_client(shards):
    y = _labels(6000)
    parts = partition_shards(y, 20, shards, _rng())
    assert len(parts) == 20
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx)  # at most once
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)
        assert len(np.unique(y[p])) <= 2 * shards
    assert _mean_max_share(parts, y) > 0.25  # far from IID (~0.13 at 600 samples per client)


def test_shards_deterministic_at_10000_clients():
    y = _labels(600_000)
    a = partition_shards(y, 10_000, 2, _rng())
    b = partition_shards(y, 10_000, 2, _rng())
    assert all(np.array_equal(p, q) for p, q in zip(a[:100], b[:100]))


def test_shards_fewer_samples_than_shards_names_the_key():
    with pytest.raises(DataError) as e:
        partition_shards(_labels(39), 20, 2, _rng())
    assert e.value.key == "data.shards_per_client"
    assert "data.num_clients" in e.value.message


@pytest.mark.parametrize("n,expected_test", [(2, 1), (3, 1), (10, 2), (11, 2), (13, 3), (100, 20), (1000, 200)])
def test_split_train_test_sizes_and_disjointness(n, expected_test):
    idx = np.sort(np.random.default_rng(0).choice(10_000, n, replace=False))
    train, test = split_train_test(idx, 0.2, _rng())
    assert len(test) == expected_test and len(train) == n - expected_test
    assert not set(train) & set(test)
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), idx)
    assert train.dtype == test.dtype == np.int64
    assert np.all(np.diff(train) > 0) and np.all(np.diff(test) > 0)


def test_split_train_test_keeps_at_least_one_train_sample():
    train, test = split_train_test(np.arange(5), 0.99, _rng())
    assert len(train) == 1 and len(test) == 4


def test_split_train_test_needs_two_samples():
    with pytest.raises(DataError) as e:
        split_train_test(np.array([3]), 0.2, _rng())
    assert e.value.key == "data.num_clients"


def test_the_central_partition_is_one_client_holding_all_training_data():
    from fedray.load import load_config
    from fedray.data import build_federated_data

    cfg = load_config("synthetic", {"data.partition": "central", "data.synthetic_train_samples": 300})
    assert cfg.data.num_clients == 1 and cfg.federation.clients_per_round == 1
    data = build_federated_data(cfg.data, cfg.seed)
    assert data.num_clients == 1
    held = sorted([*data.client_train[0].tolist(), *data.client_test[0].tolist()])
    assert held == list(range(len(data.train_y)))  # every training sample, split 80/20 as every client's
