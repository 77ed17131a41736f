"""The diagnostic probe a method asks for (``fedray.runtime.server_inputs.diagnostic_probe``), by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedray.adversary.data import data_attack
from fedray.data import build_federated_data
from fedray.data.federated import to_float
from fedray.errors import RunFailure
from fedray.methods import validate_experiment
from fedray.runtime.server_core import ServerCore
from fedray.runtime.server_inputs import client_label_counts, diagnostic_probe
from tests.conftest import DAFKD_TINY, tiny_config

CPU = torch.device("cpu")
N = 4  # algorithm.diag_samples


@pytest.fixture(scope="module")
def probed():
    """DaFKD asking for N images a client, clients 0 and 1 backdoored: its config, data, algorithm and attack."""
    cfg = validate_experiment(tiny_config(**DAFKD_TINY, algorithm__name="dafkd", algorithm__diag_samples=N,
                                          adversary__attack="backdoor", adversary__clients=[0, 1]))
    data = build_federated_data(cfg.data, cfg.seed)
    return cfg, data, ServerCore(cfg, data, CPU).algo, data_attack(cfg, data.num_classes)


def _rows(images: torch.Tensor, pool: np.ndarray, spec) -> list[int]:
    """The row of ``pool`` (uint8 images) that each probe image is, normalised as the probe normalises them."""
    flat = to_float(torch.from_numpy(np.array(pool)), spec.mean, spec.std).flatten(1)
    rows = []
    for image in images.flatten(1):
        (hit,) = torch.nonzero((flat == image).all(dim=1)).flatten().tolist()  # exactly one row
        rows.append(hit)
    return rows


def test_the_probe_is_ten_n_test_images_and_n_of_each_clients_own_poisoned_as_it_holds_them(probed):
    """Client 0 (malicious) holds its rows in reverse order, as a partition need not sort them."""
    cfg, data, algo, attack = probed
    kept = data.client_train[0]
    data.client_train[0] = kept[::-1]
    try:
        probe = diagnostic_probe(data, algo, cfg.seed, CPU, attack)
        _check_probe(probe, data, algo, attack)
    finally:
        data.client_train[0] = kept


def _check_probe(probe, data, algo, attack) -> None:
    rows = _rows(probe.test_x, data.test_x, algo.spec)
    assert len(rows) == 10 * N and len(set(rows)) == 10 * N and rows == sorted(rows)  # distinct, in data order
    assert probe.test_y.tolist() == data.test_y[rows].tolist()
    assert sorted(probe.client_x) == list(range(data.num_clients))
    for cid, idx in enumerate(data.client_train):
        held = attack.data(cid, data.train_x[idx], data.train_y[idx])[0] if cid in attack.clients else data.train_x[idx]
        own = _rows(probe.client_x[cid], held, algo.spec)  # positions within the client's rows, as it holds them
        assert len(own) == N and len(set(own)) == N
        assert np.all(np.diff(idx[own]) > 0), "not in the dataset's order"
        if cid in attack.clients:  # the poisoned images, not the clean ones of the same rows
            clean = to_float(torch.from_numpy(data.train_x[idx[own]]), algo.spec.mean, algo.spec.std)
            assert not torch.equal(probe.client_x[cid], clean)
    np.testing.assert_array_equal(probe.label_counts.numpy(), client_label_counts(data, attack))
    assert probe.reader is None  # diag_reader off


def test_the_probe_is_drawn_from_the_run_seed_alone(probed):
    cfg, data, algo, attack = probed
    first, again = (diagnostic_probe(data, algo, cfg.seed, CPU, attack) for _ in range(2))
    other = diagnostic_probe(data, algo, cfg.seed + 1, CPU, attack)
    assert torch.equal(first.test_x, again.test_x) and torch.equal(first.client_x[3], again.client_x[3])
    assert not torch.equal(first.test_x, other.test_x) and not torch.equal(first.client_x[3], other.client_x[3])


def test_a_small_client_gives_every_image_it_has_and_no_probe_is_made_unasked(probed):
    cfg, data, algo, attack = probed
    small = data.client_train[2][:2]
    data.client_train[2], kept = small, data.client_train[2]
    try:
        probe = diagnostic_probe(data, algo, cfg.seed, CPU, attack)
    finally:
        data.client_train[2] = kept
    assert sorted(_rows(probe.client_x[2], data.train_x[small], algo.spec)) == [0, 1]
    unasked = ServerCore(validate_experiment(tiny_config(**DAFKD_TINY, algorithm__name="dafkd",
                                                         algorithm__diag_samples=0)), data, CPU).algo
    assert diagnostic_probe(data, unasked, cfg.seed, CPU) is None


def test_clients_made_on_demand_are_refused_a_probe_naming_the_partition(probed):
    cfg, _, algo, _ = probed
    on_demand = tiny_config(data__partition="on_demand", data__num_clients=1000, federation__clients_per_round=5)
    with pytest.raises(RunFailure, match="data.partition: dafkd's diagnostics"):
        diagnostic_probe(build_federated_data(on_demand.data, on_demand.seed), algo, cfg.seed, CPU)
