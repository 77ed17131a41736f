"""Per-client models through the isolated baseline (algorithm.name=local): architectures assigned
round-robin, weights kept as client state, nothing exchanged, personalised evaluation, and methods that average
parameters refusing several architectures. (The same figures on the local and the Ray runtime, heterogeneous models
too: tests/test_every_method.py.)"""

import numpy as np
import pytest
import torch

from fedray.methods import validate_experiment
from fedray.methods.api import PersonalModel
from fedray.data import build_federated_data
from fedray.errors import ConfigError
from fedray.evaluation import Evaluator, personal_metrics
from fedray.models import build_model
from fedray.runtime import make_runtime
from fedray.seeding import sample_clients
from fedray.simulation import run_experiment
from tests.conftest import tiny_config

HETERO = {"algorithm__name": "local", "model__client_models": ["lenet5", "resnet8"]}


def _figures(result):
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in result.history]


def test_architectures_are_assigned_round_robin():
    cfg = tiny_config(**HETERO)
    assert [cfg.model.client_architecture(k) for k in range(5)] == ["lenet5", "resnet8", "lenet5", "resnet8", "lenet5"]
    assert tiny_config().model.client_architecture(3) == "lenet5"  # absent: model.name


def test_local_training_keeps_each_clients_own_model_and_sends_nothing():
    cfg = tiny_config(**HETERO, federation__rounds=3)
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        rows = [rt.run_round(r, sample_clients(cfg.seed, r, data.num_clients, 3)) for r in (1, 2, 3)]
        states = rt.export_state().clients
        assert all(o.payload_bytes == 0 for o in rows)
        assert all(info["bytes_up"] == 0 for o in rows for info in o.client_infos)
        sampled = {c for r in (1, 2, 3) for c in sample_clients(cfg.seed, r, data.num_clients, 3)}
        assert set(states) == sampled  # memory only for clients that trained
        for cid, st in states.items():
            assert isinstance(st, PersonalModel) and st.client_id == cid
            assert st.architecture == cfg.model.client_architecture(cid)
            ref = build_model(st.architecture, data.input_shape, data.num_classes).state_dict()
            assert set(st.weights) == set(ref) and all(st.weights[k].shape == ref[k].shape for k in ref)
            init = rt.worker.algo.init_client_state(cid).weights
            assert any(not torch.equal(st.weights[k], init[k]) for k in init)  # trained, not the initial model


def test_server_step_keeps_nothing_and_nothing_is_sent():
    from fedray.learning.weights import nbytes
    from fedray.methods.api import ServerContext
    from fedray.methods.local import EmptyUpload, Local

    algo = Local(validate_experiment(tiny_config(**HETERO)), None)
    state = algo.init_server_state(None)
    new, metrics = algo.server_update(state, [EmptyUpload(), EmptyUpload()],
                                      ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=None))
    assert new == state and metrics == {}
    assert nbytes(algo.broadcast(new, 2)) == 0 and nbytes(EmptyUpload()) == 0


def test_a_clients_model_continues_from_its_last_round():
    """Training round 2 starts from the weights round 1 left, not from a fresh initialisation."""
    cfg = tiny_config(algorithm__name="local", data__num_clients=3, federation__clients_per_round=3)
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        rt.run_round(1, [0, 1, 2])
        after_one = rt.export_state().clients[0].weights
        fresh = rt.worker.train(2, 0, rt.server.payload(1)[0], None)[1].weights
        continued = rt.worker.train(2, 0, rt.server.payload(1)[0], rt.client_states[0])[1].weights
    assert any(not torch.equal(fresh[k], continued[k]) for k in fresh)
    assert any(not torch.equal(after_one[k], continued[k]) for k in after_one)


def test_personalised_evaluation_scores_each_clients_own_model():
    cfg = tiny_config(**HETERO, federation__rounds=1)
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        rt.run_round(1, [0, 1, 4])
        got = rt.evaluate()
        per_client = rt.client_scores().columns()
        states = rt.export_state().clients
        algo = rt.worker.algo
    ev = Evaluator(data, None, torch.device("cpu"), 64)
    own_acc, own_loss, glob_acc, correct, total = [], [], [], 0, 0
    for cid in range(data.num_clients):
        st = states.get(cid) or algo.init_client_state(cid)
        model = build_model(st.architecture, data.input_shape, data.num_classes)
        model.load_state_dict(st.weights)
        model.eval()
        with torch.no_grad():
            idx = data.client_test[cid]
            x = torch.from_numpy(data.train_x[idx]).float().div(255).sub(data.mean[0]).div(data.std[0])
            y = torch.from_numpy(data.train_y[idx]).long()
            own = (model(x).argmax(1).numpy() == data.train_y[idx])
            own_loss.append(torch.nn.functional.cross_entropy(model(x), y).item())
            xt = torch.from_numpy(data.test_x).float().div(255).sub(data.mean[0]).div(data.std[0])
            glob = (model(xt).argmax(1).numpy() == data.test_y)
        own_acc.append(own.mean())
        glob_acc.append(glob.mean())
        correct, total = correct + own.sum(), total + len(own)
        assert ev.personal_counts(model, cid) == (own.sum(), len(own), glob.sum(), len(glob), 0, 0)
    assert got["eval/accuracy"] == pytest.approx(np.mean(glob_acc))
    assert got["eval/amp"] == pytest.approx(correct / total)
    assert got["eval/fm"] == pytest.approx(np.var(own_acc))
    assert got["eval/wlp"] == pytest.approx(min(own_acc))
    # clients.parquet's rows of this evaluation: every client's own model on its own split and on the global test
    assert per_client["client"].tolist() == list(range(data.num_clients))
    assert per_client["accuracy"] == pytest.approx(own_acc) and per_client["loss"] == pytest.approx(own_loss, rel=1e-5)
    assert per_client["global_accuracy"] == pytest.approx(glob_acc) and "val_accuracy" not in per_client


def test_personal_metrics_by_hand():
    # client 0: 3/4 own, 50/100 global, 7/10 validation; client 1: 1/2 own, 30/100 global, 4/10 validation
    m = personal_metrics(np.array([[3, 4, 50, 100, 7, 10], [1, 2, 30, 100, 4, 10]]))
    assert m["eval/accuracy"] == pytest.approx(0.4)  # (0.5 + 0.3) / 2
    assert m["eval/amp"] == pytest.approx(4 / 6)
    assert m["eval/fm"] == pytest.approx(0.015625)  # mean 0.625: ((0.125)^2 + (0.125)^2) / 2
    assert m["eval/wlp"] == pytest.approx(0.5)
    assert m["val/accuracy"] == pytest.approx(0.55)  # (0.7 + 0.4) / 2
    assert "val/accuracy" not in personal_metrics(np.array([[3, 4, 50, 100, 0, 0]]))


def test_two_rounds_run_and_same_seed_same_numbers():
    cfg = tiny_config(**HETERO)
    a, b = run_experiment(cfg, progress=False), run_experiment(cfg, progress=False)
    assert _figures(a) == _figures(b)
    assert a.summary["comm/bytes_up"] == 0 and a.summary["comm/bytes_down"] == 0


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "qffl", "fedgkd", "fedkf", "dafkd"])
def test_methods_that_average_refuse_several_architectures(method):
    with pytest.raises(ConfigError) as err:
        validate_experiment(tiny_config(algorithm__name=method, model__client_models=["lenet5", "resnet8"]))
    assert err.value.key == "model.client_models" and "local" in str(err.value)
    validate_experiment(tiny_config(algorithm__name=method, model__client_models=["lenet5"]))  # one = model.name


def test_unknown_client_model_is_refused():
    with pytest.raises(ConfigError) as err:
        validate_experiment(tiny_config(algorithm__name="local", model__client_models=["lenet5", "nope"]))
    assert err.value.key == "model.client_models"


def test_finished_run_records_each_clients_figures(tmp_path):
    import json

    from fedray.record.run_dir import CLIENTS_FILE

    result = run_experiment(tiny_config(**HETERO), tmp_path / "run", progress=False)
    clients = json.loads((tmp_path / "run" / CLIENTS_FILE).read_text())
    assert [c["client"] for c in clients] == list(range(6))
    assert [c["architecture"] for c in clients] == ["lenet5", "resnet8"] * 3
    assert np.mean([c["global_accuracy"] for c in clients]) == pytest.approx(result.summary["eval/accuracy"])
    correct, total = sum(c["own_correct"] for c in clients), sum(c["own_samples"] for c in clients)
    assert correct / total == pytest.approx(result.summary["eval/amp"])
    assert not (tmp_path / "global" / CLIENTS_FILE).exists()
    run_experiment(tiny_config(), tmp_path / "global", progress=False)  # a global model: no per-client file
    assert not (tmp_path / "global" / CLIENTS_FILE).exists()
