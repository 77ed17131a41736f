"""What MLflow records of where a run's figures come from: its data as the run's input (with the digest of its
client split), the final model as an MLflow PyTorch model that loads back to the same accuracy, MLflow's system
metrics, a readable run name and the command line as its Source."""

import json
import os

import mlflow
import mlflow.pytorch
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from fedray.cli import main
from fedray.load import load_config
from fedray.data.federated import build_federated_data, to_float
from fedray.record.provenance import run_label
from tests.test_cli import TINY_ARGS

ARGS = [a for a in TINY_ARGS if not a.startswith("tracking.")]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Three tracked runs in one store: seed 0 with fedavg and with fedprox (the same split), seed 1 (another)."""
    root = tmp_path_factory.mktemp("prov")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    runs = {}
    for name, extra in (("a", ["seed=0"]), ("b", ["seed=0", "algorithm.name=fedprox", "algorithm.mu=0.1"]),
                        ("c", ["seed=1"])):
        argv = ["run", *ARGS, *extra, f"tracking.uri={uri}", "tracking.experiment=prov",
                "--output-dir", str(root / name), "--no-progress"]
        assert main(argv) == 0
        runs[name] = json.loads((root / name / "mlflow_run.json").read_text())["run_id"]
    return MlflowClient(uri), runs, root


@pytest.fixture
def store(monkeypatch):
    """Load models from the store ``uri`` as a user does: MLFLOW_TRACKING_URI set to it."""
    def use(uri):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
    yield use
    mlflow.set_tracking_uri(None)


def test_runs_on_one_split_share_the_input_digest_and_another_seed_gets_another(tracked):
    client, runs, _ = tracked
    inputs = {k: client.get_run(r).inputs.dataset_inputs for k, r in runs.items()}
    assert all(len(v) == 1 for v in inputs.values())
    digest = {k: v[0].dataset.digest for k, v in inputs.items()}
    assert digest["a"] == digest["b"] != digest["c"] and len(digest["a"]) == 16
    dataset = inputs["a"][0].dataset
    profile = json.loads(dataset.profile)
    assert dataset.name == "synthetic" and profile["num_clients"] == 6 and profile["partition"] == "dirichlet"
    assert profile["client_train_samples"] + profile["client_test_samples"] == 600
    assert {t.key: t.value for t in inputs["a"][0].tags} == {"mlflow.data.context": "train"}


def test_the_digest_is_of_the_client_index_lists():
    cfg = load_config("synthetic", {"data.num_clients": 6, "data.synthetic_train_samples": 600})
    data = build_federated_data(cfg.data, 0)
    same = build_federated_data(cfg.data, 0)
    assert data.partition_digest() == same.partition_digest()
    same.client_train[0] = same.client_train[0][::-1].copy()  # one client's samples in another order
    assert data.partition_digest() != same.partition_digest()
    moved = build_federated_data(cfg.data, 0)  # one sample moved from client 0's list to client 1's
    moved.client_train[1] = np.concatenate([moved.client_train[0][-1:], moved.client_train[1]])
    moved.client_train[0] = moved.client_train[0][:-1]
    assert data.partition_digest() != moved.partition_digest()


def test_the_logged_model_loads_back_and_scores_the_runs_accuracy(tracked, store):
    client, runs, root = tracked
    store(client.tracking_uri)
    run = client.get_run(runs["a"])
    (output,) = run.outputs.model_outputs
    assert output.step == 3  # the last round
    # filed in the run's experiment, its files in the store's artifact folder (not MLflow's Default, ./mlruns)
    logged = client.get_logged_model(output.model_id)
    assert logged.experiment_id == run.info.experiment_id
    assert logged.artifact_location.startswith((root / "mlartifacts").as_uri())
    model = mlflow.pytorch.load_model(f"models:/{output.model_id}")
    cfg = load_config(str(root / "a" / "config.yaml"))
    data = build_federated_data(cfg.data, cfg.seed)
    info = mlflow.models.get_model_info(f"models:/{output.model_id}")
    x = to_float(torch.from_numpy(data.test_x), info.metadata["normalise_mean"], info.metadata["normalise_std"])
    with torch.no_grad():
        accuracy = (model(x).argmax(1).numpy() == data.test_y).mean()
    summary = json.loads((root / "a" / "summary.json").read_text())
    assert accuracy == pytest.approx(summary["eval/accuracy"], abs=1e-12)


def test_runs_carry_a_readable_name_their_command_and_system_metrics(tracked):
    client, runs, root = tracked
    run = client.get_run(runs["b"])
    assert run.info.run_name == "fedprox synthetic alpha=1 seed=0"
    source = run.data.tags["mlflow.source.name"]
    assert source.startswith("fedray run synthetic ") and "algorithm.name=fedprox" in source
    assert source.endswith(f"--output-dir {root / 'b'} --no-progress") and run.data.tags["mlflow.source.type"] == "LOCAL"
    assert run.data.tags["fedray.config"] == "synthetic"
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system


def test_run_labels_name_method_data_split_seed_and_searched_values():
    cfg = load_config("quickstart", {"data.alpha": 0.1, "seed": 2, "algorithm.name": "fedprox"})
    assert run_label(cfg) == "fedprox fashion_mnist alpha=0.1 seed=2"
    assert run_label(cfg, {"federation.lr": 0.0123456, "algorithm.mu": 0.1, "seed": 2, "data.alpha": 0.1}) == \
        "fedprox fashion_mnist alpha=0.1 seed=2 lr=0.0123 mu=0.1"
    assert run_label(load_config("quickstart", {"data.partition": "iid"})).endswith("iid seed=0")


def test_a_personalised_runs_clients_models_are_one_mlflow_model(tmp_path, store, monkeypatch):
    """``local``: every client its own model, of two architectures; the logged model is a ModuleDict by
    client id, and each client's model scores its clients.json figure on the global test set."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(key, raising=False)
    before = mlflow.get_tracking_uri()
    assert main(["run", *ARGS, "algorithm.name=local", "model.client_models=[lenet5,resnet8_bn]",
                 f"tracking.uri={uri}", "tracking.system_metrics_s=0", "--output-dir", str(tmp_path / "r"),
                 "--no-progress"]) == 0
    # logging the model leaves MLflow's fluent state and the environment later subprocesses inherit as they were
    assert "MLFLOW_TRACKING_URI" not in os.environ and "MLFLOW_EXPERIMENT_ID" not in os.environ
    assert mlflow.get_tracking_uri() == before
    run_id = json.loads((tmp_path / "r" / "mlflow_run.json").read_text())["run_id"]
    run = MlflowClient(uri).get_run(run_id)
    store(uri)
    assert not (tmp_path / "mlruns").exists()  # nothing in MLflow's default folder of the working directory
    assert not any(k.startswith("system/") for k in run.data.metrics)  # system_metrics_s=0: none
    models = mlflow.pytorch.load_model(f"models:/{run.outputs.model_outputs[0].model_id}")
    trained = sorted(torch.load(tmp_path / "r" / "model.pt", weights_only=True))  # the clients with a model
    assert isinstance(models, torch.nn.ModuleDict) and sorted(models, key=int) == [str(k) for k in trained]
    assert len({type(m).__name__ for m in models.values()}) == 2  # each client's own architecture
    cfg = load_config(str(tmp_path / "r" / "config.yaml"))
    data = build_federated_data(cfg.data, cfg.seed)
    x = to_float(torch.from_numpy(data.test_x), data.mean, data.std)
    clients = json.loads((tmp_path / "r" / "clients.json").read_text())
    with torch.no_grad():
        for row in (r for r in clients if r["client"] in trained):
            accuracy = (models[str(row["client"])](x).argmax(1).numpy() == data.test_y).mean()
            assert accuracy == pytest.approx(row["global_accuracy"], abs=1e-12)
