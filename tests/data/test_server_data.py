"""Server-side data (``data.server_data``) on synthetic data, and the new partitioners' unit behaviour."""

import numpy as np
import pytest

from fedray.load import load_config
from fedray.data import (
    build_federated_data,
    partition_by_domain,
    partition_domain_dirichlet,
    partition_summary,
    select_holdout,
)
from fedray.errors import DataError

BASE = {
    "data.dataset": "synthetic",
    "data.num_clients": 10,
    "data.alpha": 1.0,
    "data.synthetic_train_samples": 2000,
    "data.synthetic_test_samples": 100,
    "data.server_data.kind": "holdout",
    "data.server_data.per_class": 20,
}


def data_cfg(**kw):
    """``BASE`` with ``data.*`` overrides given as keywords (``server_data__kind="none"``)."""
    return load_config(None, {**BASE, **{"data." + k.replace("__", "."): v for k, v in kw.items()}}).data


def rows(x: np.ndarray) -> set[bytes]:
    return {r.tobytes() for r in x}


@pytest.fixture(scope="module")
def fd():
    return build_federated_data(data_cfg(), seed=1)


def test_holdout_takes_exactly_per_class_and_is_labelled(fd):
    s = fd.server
    assert s is not None and s.labelled and s.domain is None
    np.testing.assert_array_equal(np.bincount(s.y, minlength=10), [20] * 10)
    assert s.x.shape == (200, 1, 16, 16) and s.x.dtype == np.uint8 and s.y.dtype == np.int64
    np.testing.assert_array_equal(s.visible_y(), s.y)
    # Taken out of the training set before partitioning: the clients share out the remaining 1,800.
    assert fd.train_x.shape[0] == 1800 and len(fd.train_y) == 1800
    everything = np.concatenate(fd.client_train + fd.client_test)
    np.testing.assert_array_equal(np.sort(everything), np.arange(1800))
    assert fd.domains == () and fd.train_domain is None and fd.client_domain is None


def test_holdout_images_are_in_no_client(fd):
    """By content: none of the server's images is among any client's (train or local test) images."""
    whole = build_federated_data(data_cfg(server_data__kind="none"), seed=1)
    assert whole.server is None and whole.train_x.shape[0] == 2000
    server = rows(fd.server.x)
    assert len(server) == 200 and server <= rows(whole.train_x)  # real training images
    for tr, te in zip(fd.client_train, fd.client_test):
        assert not server & rows(fd.train_x[np.concatenate([tr, te])])


def test_holdout_is_deterministic_and_on_its_own_stream(fd):
    again = build_federated_data(data_cfg(), seed=1)
    np.testing.assert_array_equal(again.server.x, fd.server.x)
    np.testing.assert_array_equal(again.server.y, fd.server.y)
    assert all(np.array_equal(a, b) for a, b in zip(again.client_train, fd.client_train))
    # Another partition draws from another stream: the held-out samples do not move.
    iid = build_federated_data(data_cfg(partition="iid"), seed=1)
    np.testing.assert_array_equal(iid.server.x, fd.server.x)
    other = build_federated_data(data_cfg(), seed=2)
    assert not np.array_equal(other.server.x, fd.server.x)


def test_holdout_kept_in_training_copies_the_samples_and_leaves_the_partition(fd):
    """DaFKD's FedDF proxy: unlabelled training samples that the clients keep training on."""
    kept = build_federated_data(data_cfg(server_data__keep_in_training=True, server_data__labelled=False), seed=1)
    whole = build_federated_data(data_cfg(server_data__kind="none"), seed=1)
    np.testing.assert_array_equal(kept.server.x, fd.server.x)  # the same samples as the holdout's
    np.testing.assert_array_equal(kept.train_x, whole.train_x)  # nothing taken out
    assert all(np.array_equal(a, b) for a, b in zip(kept.client_train, whole.client_train))
    assert rows(kept.server.x) <= rows(np.concatenate([kept.train_x[i] for i in kept.client_train + kept.client_test]))


def test_holdout_labels_can_be_hidden():
    fd = build_federated_data(data_cfg(server_data__labelled=False), seed=0)
    assert not fd.server.labelled and fd.server.visible_y() is None
    np.testing.assert_array_equal(np.bincount(fd.server.y), [20] * 10)  # still stored for diagnostics


def test_holdout_too_few_samples_names_the_key():
    with pytest.raises(DataError) as e:
        build_federated_data(data_cfg(server_data__per_class=200), seed=0)  # 200 per class in all
    assert e.value.key == "data.server_data.per_class"
    assert "class 0 has only 200" in e.value.message and "at most 199" in e.value.message


def test_no_server_data_by_default():
    fd = build_federated_data(data_cfg(server_data__kind="none"), seed=0)
    assert fd.server is None
    assert all(r["domain"] is None for r in partition_summary(fd))


def test_select_holdout_unit():
    labels = np.array([0, 1, 2] * 5)
    held = select_holdout(labels, 2, 3, np.random.default_rng(0))
    assert held.dtype == np.int64 and np.all(np.diff(held) > 0)
    np.testing.assert_array_equal(np.bincount(labels[held]), [2, 2, 2])
    with pytest.raises(DataError, match="class 3 has only 0"):
        select_holdout(labels, 1, 4, np.random.default_rng(0))  # a class with no samples at all


def test_partition_by_domain_and_domain_dirichlet_unit():
    domain = np.repeat([2, 0, 1], 40)  # domain ids need not be sorted in the data
    labels = np.tile(np.arange(4), 30)
    parts = partition_by_domain(domain, [0, 2])
    np.testing.assert_array_equal(parts[0], np.arange(40, 80))
    np.testing.assert_array_equal(parts[1], np.arange(0, 40))
    dd = partition_domain_dirichlet(labels, domain, [0, 1, 2], 3, 1.0, 5, np.random.default_rng(0))
    assert len(dd) == 9
    for k, idx in enumerate(dd):
        assert len(idx) >= 5 and np.all(np.diff(idx) > 0)
        assert (domain[idx] == [0, 1, 2][k // 3]).all()  # domain-major numbering
    np.testing.assert_array_equal(np.sort(np.concatenate(dd)), np.arange(120))
    with pytest.raises(DataError) as e:
        partition_domain_dirichlet(labels, domain, [0], 50, 1.0, 2, np.random.default_rng(0), names=["x"])
    assert e.value.key == "data.clients_per_domain" and "domain 'x'" in e.value.message


# --- the validation set (data.val_per_class) ------------------------------------------------------------------

def test_validation_set_is_per_class_apart_from_clients_and_server_and_seeded():
    fd = build_federated_data(data_cfg(val_per_class=15), seed=1)
    np.testing.assert_array_equal(np.bincount(fd.val_y, minlength=10), [15] * 10)
    assert fd.num_val == 150 and fd.val_x.shape == (150, 1, 16, 16) and fd.val_x.dtype == np.uint8
    # Taken out after the server's 200: the clients share out the remaining 1,650, none of them validation images
    assert fd.train_x.shape[0] == 1650
    everything = np.concatenate(fd.client_train + fd.client_test)
    np.testing.assert_array_equal(np.sort(everything), np.arange(1650))
    whole = build_federated_data(data_cfg(server_data__kind="none"), seed=1)
    val = rows(fd.val_x)
    assert len(val) == 150 and val <= rows(whole.train_x) and not val & rows(fd.server.x)
    assert not val & rows(fd.train_x)
    # The server's holdout stays where it was without a validation set; same seed, same validation set
    np.testing.assert_array_equal(fd.server.x, build_federated_data(data_cfg(), seed=1).server.x)
    again = build_federated_data(data_cfg(val_per_class=15), seed=1)
    np.testing.assert_array_equal(again.val_x, fd.val_x)
    assert not np.array_equal(build_federated_data(data_cfg(val_per_class=15), seed=2).val_x, fd.val_x)


def test_no_validation_set_by_default_and_too_large_a_one_names_its_key():
    fd = build_federated_data(data_cfg(), seed=1)
    assert fd.num_val == 0 and fd.val_x is None and fd.train_x.shape[0] == 1800
    with pytest.raises(DataError) as e:
        build_federated_data(data_cfg(val_per_class=180), seed=0)  # 200 per class, 20 of them the server's
    assert e.value.key == "data.val_per_class" and "for validation" in e.value.message
    assert "at most 179" in e.value.message
