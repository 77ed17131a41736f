"""Server-side data reaches the server's instance of a method only, with labels only when labelled,
on the local and the Ray runtime alike."""

import cloudpickle
import pytest

from fedray.data import build_federated_data
from fedray.simulation import run_experiment
from tests.conftest import tiny_config
from tests.runtime import server_probe

cloudpickle.register_pickle_by_value(server_probe)  # Ray workers cannot import tests/


def _probe(**overrides):
    cfg = tiny_config(algorithm__name="test_server_probe", federation__rounds=1, data__server_data__kind="holdout",
                      data__server_data__per_class=3, **overrides)
    data = build_federated_data(cfg.data, cfg.seed)
    return run_experiment(cfg, progress=False, data=data).history[0], data


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_labelled_holdout_is_seen_by_the_server_only(backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_local")
    row, data = _probe(runtime__backend=backend)
    assert row["server/data_size"] == 30 and row["server/has_labels"] == 1.0  # 3 per class x 10 classes
    assert row["server/label_sum"] == float(data.server.y.sum())
    assert row["test/client_sees_server_data"] == 0.0


def test_unlabelled_server_data_hides_its_labels_from_the_method():
    row, data = _probe(data__server_data__labelled=False)
    assert row["server/data_size"] == 30 and row["server/has_labels"] == 0.0
    assert data.server.y is not None  # kept for simulation-only diagnostics


def test_without_server_data_the_server_has_none():
    cfg = tiny_config(algorithm__name="test_server_probe", federation__rounds=1)
    assert run_experiment(cfg, progress=False).history[0]["server/data_size"] == -1.0
