"""What a run came from, as MLflow records it: its name (method, data, split, seed), the command that started
it, the fedray commit, its data (:func:`data_facts`: dataset, split profile, the digest of the client index
lists) and its final model as a module. Plain values and functions; :mod:`fedray.record.tracking` writes them.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedray.system.traces import trace_digests


def git_commit() -> str | None:
    """The commit of the fedray checkout, when it is one."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_label(cfg, searched: dict[str, Any] | None = None) -> str:
    """A run's name in MLflow's runs list: method, dataset, split, seed (``fedavg fashion_mnist alpha=0.1 seed=0``),
    then a trial's searched values not already in it (``lr=0.01 mu=0.1``, the last part of each key)."""
    d = cfg.data
    split = {"dirichlet": f"alpha={d.alpha:g}", "iid": "iid", "shards": f"shards={d.shards_per_client}",
             "domain": "domains", "domain_dirichlet": f"domains alpha={d.alpha:g}"}.get(d.partition, d.partition)
    parts = [cfg.algorithm.name, d.dataset, split, f"seed={cfg.seed}"]
    for key, value in (searched or {}).items():
        if key not in ("seed", "algorithm.name", "data.dataset", "data.alpha", "data.partition"):
            parts.append(f"{key.rsplit('.', 1)[-1]}={value:.3g}" if isinstance(value, float)
                         else f"{key.rsplit('.', 1)[-1]}={value}")
    return " ".join(parts)


def command_line(argv: list[str]) -> str:
    """The command that started a run, as MLflow's Source: ``fedray run quickstart seed=1``."""
    import shlex

    return shlex.join(["fedray", *argv])


def data_facts(cfg, data) -> dict[str, Any]:
    """What MLflow records of a run's data (plain values: a Tune trial sends them to the sweep's driver):
    ``name`` (the dataset and its domains), ``digest`` of its client split
    (:meth:`~fedray.data.federated.FederatedData.partition_digest`), ``source`` (where it was read from),
    ``profile`` (partition, clients, samples), and what its model needs (input shape, classes, normalisation)."""
    profile = {"partition": cfg.data.partition, "num_clients": data.num_clients,
               **({"alpha": cfg.data.alpha} if "dirichlet" in cfg.data.partition else {}),
               "client_train_samples": int(data.client_sizes().sum()),
               "client_test_samples": int(data.client_test_sizes().sum()), "test_samples": int(len(data.test_y)),
               "val_samples": data.num_val, "server_samples": 0 if data.server is None else len(data.server),
               "classes": data.num_classes, "input_shape": list(data.input_shape), "seed": cfg.seed}
    return {"name": data.dataset + (f" ({', '.join(data.domains)})" if data.domains else ""),
            "digest": data.partition_digest(),
            "source": {"dataset": cfg.data.dataset, "data_dir": cfg.data.data_dir or "fedray's default"},
            "profile": profile, "input_shape": list(data.input_shape), "num_classes": int(data.num_classes),
            "mean": [float(v) for v in data.mean], "std": [float(v) for v in data.std],
            "traces": trace_digests(cfg.system)}


def dataset_inputs(facts: dict[str, Any]) -> list:
    """:func:`data_facts` as MLflow dataset inputs: the data of the training context (the UI's Dataset column), and
    each trace file of the simulated system in the ``system`` context (its SHA-256, shortened to MLflow's digest
    column, whole in its source)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = Dataset(name=facts["name"], digest=facts["digest"], source_type="local",
                      source=json.dumps(facts["source"]), profile=json.dumps(facts["profile"]))
    inputs = [DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "train")])]
    for key, trace in facts.get("traces", {}).items():
        inputs.append(DatasetInput(Dataset(name=key, digest=trace["sha256"][:32], source_type="local",
                                           source=json.dumps(trace)),
                                   tags=[InputTag("mlflow.data.context", "system")]))
    return inputs


def final_model(cfg, facts: dict[str, Any], weights):
    """The final model as a ``torch.nn.Module`` for MLflow: the global model with ``model.pt``'s weights, or for
    a personalised method (``weights`` maps client ids to weights) a ``ModuleDict`` of every client's own model
    keyed by client id (``model["3"]``: client 3's)."""
    import torch

    from fedray.models import build_model

    def module(architecture: str, state) -> torch.nn.Module:
        m = build_model(architecture, tuple(facts["input_shape"]), facts["num_classes"])
        m.load_state_dict(state)
        return m.eval()

    if weights and all(isinstance(k, int) for k in weights):
        return torch.nn.ModuleDict({str(cid): module(cfg.model.client_architecture(cid), w)
                                    for cid, w in sorted(weights.items())})
    return module(cfg.model.name, weights)


@contextmanager
def fluent_store(uri: str, experiment_id: str):
    """MLflow's fluent API (``mlflow.pytorch.log_model``) pointed at ``uri`` and ``experiment_id`` for the block,
    then put back as it was. The fluent API writes to its global store and active experiment (left unset, a model
    would go to the Default experiment and ./mlruns), and setting them also exports MLFLOW_TRACKING_URI and
    MLFLOW_EXPERIMENT_ID, which every later subprocess would inherit: those are restored too."""
    import mlflow
    from mlflow.tracking import fluent
    from mlflow.tracking._tracking_service import utils as tracking_utils

    saved = (tracking_utils._tracking_uri, getattr(fluent, "_active_experiment_id", None),
             {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")})
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=experiment_id)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved[0])
        fluent._active_experiment_id = saved[1]
        for key, value in saved[2].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
