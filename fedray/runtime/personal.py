"""Personalised evaluation (methods whose clients each own a model): the run's ``eval/*`` and ``clients.json`` from
every client's own-model figures, and the weights ``model.pt`` keeps. The same on both runtimes."""

from __future__ import annotations

import numpy as np

from fedray.config import ExperimentConfig
from fedray.learning.weights import Weights
from fedray.methods import Algorithm
from fedray.methods.api import ClientState
from fedray.report.metrics import personal_metrics


def personal_evaluation(rows: list[tuple[int, ...]]) -> dict[str, float]:
    """``eval/*`` from every client's :meth:`ClientWorkerCore.evaluate_clients` row (client-id order)."""
    return personal_metrics(np.array(rows, dtype=np.float64))


def client_table(cfg: ExperimentConfig, rows: list[tuple[int, ...]]) -> list[dict]:
    """Per-client figures of a personalised evaluation (``clients.json``), rows in client-id order."""
    return [{"client": cid, "architecture": cfg.model.client_architecture(cid), "own_correct": own_c,
             "own_samples": own_n, "own_accuracy": own_c / max(own_n, 1), "global_accuracy": glob_c / max(glob_n, 1),
             **({"val_accuracy": val_c / val_n} if val_n else {})}
            for cid, (own_c, own_n, glob_c, glob_n, val_c, val_n) in enumerate(rows)]


def personal_models(algo: Algorithm, states: dict[int, ClientState]) -> dict[int, Weights]:
    """{client id: own model weights} of the clients that have a state (what ``model.pt`` holds)."""
    return {cid: algo.personal_model(st).weights for cid, st in sorted(states.items())}
