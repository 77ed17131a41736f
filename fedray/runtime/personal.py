"""Personalised evaluation (methods whose clients each own a model): the run's ``eval/*``, ``clients.json`` and the
rows of ``clients.parquet`` from every client's own-model figures, and the weights ``model.pt`` keeps. The same on
both runtimes."""

from __future__ import annotations

import numpy as np

from fedray.config import ExperimentConfig
from fedray.learning.weights import Weights
from fedray.methods import Algorithm
from fedray.methods.api import ClientState
from fedray.evaluation import ClientScores, personal_attack_success, personal_metrics, personal_scores

#: A :meth:`ClientWorkerCore.evaluate_clients` row: personal_metrics' six counts, the own-split loss sum, the
#: triggered test images classified as the backdoor's target and their number, the membership audit's U and pairs.
COUNTS = 6
ROW = COUNTS + 5


def personal_evaluation(rows: list[tuple], backdoor: bool = False,
                        clients: list[int] | None = None) -> tuple[dict[str, float], ClientScores]:
    """``eval/*`` and the per-client figures from the evaluated clients' :meth:`ClientWorkerCore.evaluate_clients`
    rows (``clients``, in order; by default every client in id order); with ``backdoor``
    (``adversary.attack=backdoor``) ``eval/attack_success`` too."""
    table = np.array(rows, dtype=np.float64).reshape(-1, ROW)
    metrics = personal_metrics(table[:, :COUNTS])
    if backdoor:
        metrics["eval/attack_success"] = personal_attack_success(table[:, COUNTS + 1 : COUNTS + 3])
    pairs = table[:, COUNTS + 4].sum()
    if pairs > 0:  # the audit of the clients' own models, pooled (fedray.privacy.audit)
        metrics["diag/mia_auc"] = float(table[:, COUNTS + 3].sum() / pairs)
    return metrics, personal_scores(table[:, :COUNTS], table[:, COUNTS], clients)


def client_table(cfg: ExperimentConfig, rows: list[tuple], clients: list[int] | None = None) -> list[dict]:
    """Per-client figures of a personalised evaluation (``clients.json``): the rows of ``clients`` (by default every
    client, in id order)."""
    return [{"client": cid, "architecture": cfg.model.client_architecture(cid), "own_correct": own_c,
             "own_samples": own_n, "own_accuracy": own_c / max(own_n, 1), "global_accuracy": glob_c / max(glob_n, 1),
             **({"val_accuracy": val_c / val_n} if val_n else {})}
            for cid, (own_c, own_n, glob_c, glob_n, val_c, val_n) in zip(
                range(len(rows)) if clients is None else clients, (row[:COUNTS] for row in rows))]


def personal_models(algo: Algorithm, states: dict[int, ClientState]) -> dict[int, Weights]:
    """{client id: own model weights} of the clients that have a state (what ``model.pt`` holds)."""
    return {cid: algo.personal_model(st).weights for cid, st in sorted(states.items())}
