"""Evaluation metrics: global top-1 accuracy and FedKF's AMP / FM / WLP (Def. 1-3), rounds to target.

- ``eval/accuracy``: the global model's top-1 accuracy on the dataset's global test split (DaFKD Table 1).
- ``eval/amp``: sum_k |D_k|/|D| acc_k over every client's local 20% test split (FedKF Def. 1), which equals
  total correct / total test samples.
- ``eval/fm``: the population variance of acc_k over clients (FedKF Def. 2; fairness, lower is fairer).
- ``eval/wlp``: min_k acc_k (FedKF Def. 3; worst local performance).

All are fractions in 0..1; FM is in fraction^2 units (FedKF's tables print it x 10^3).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from fedray.data.federated import FederatedData, to_float


def client_metrics(correct: np.ndarray, total: np.ndarray) -> dict[str, float]:
    """AMP, FM and WLP from per-client counts of correct predictions and test samples."""
    has = total > 0
    acc = correct[has] / total[has]
    return {
        "eval/amp": float(correct.sum() / max(total.sum(), 1)),
        "eval/fm": float(np.var(acc)) if acc.size else math.nan,
        "eval/wlp": float(acc.min()) if acc.size else math.nan,
    }


class Evaluator:
    """Evaluates global weights on the global test set and on all clients' local test splits.

    The client test sets are gathered once into one array (with each sample's client id) so evaluating
    10,000 clients costs one batched pass, not 10,000 small ones.
    """

    def __init__(self, data: FederatedData, model: torch.nn.Module, device: torch.device, batch_size: int):
        self.model = model
        self.device = device
        self.batch_size = batch_size
        self.mean, self.std = data.mean, data.std
        # Copies: the dataset may be a read-only view of Ray's object store, which torch warns about.
        self.test_x, self.test_y = np.array(data.test_x), np.array(data.test_y)
        idx = [np.asarray(t, dtype=np.int64) for t in data.client_test]
        self.num_clients = len(idx)
        self.client_of = np.repeat(np.arange(self.num_clients), [len(i) for i in idx])
        flat = np.concatenate(idx) if idx else np.zeros(0, np.int64)
        self.local_x, self.local_y = data.train_x[flat], data.train_y[flat]

    @torch.no_grad()
    def _correct(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        out = np.empty(len(y), dtype=bool)
        for s in range(0, len(y), self.batch_size):
            xb = torch.from_numpy(x[s : s + self.batch_size]).to(self.device)
            pred = self.model(to_float(xb, self.mean, self.std)).argmax(1).cpu().numpy()
            out[s : s + self.batch_size] = pred == y[s : s + self.batch_size]
        return out

    def evaluate(self, weights: dict[str, torch.Tensor]) -> dict[str, float]:
        self.model.load_state_dict(weights)
        self.model.eval()
        metrics = {"eval/accuracy": float(self._correct(self.test_x, self.test_y).mean())}
        ok = self._correct(self.local_x, self.local_y)
        correct = np.bincount(self.client_of, weights=ok, minlength=self.num_clients)
        total = np.bincount(self.client_of, minlength=self.num_clients)
        metrics.update(client_metrics(correct, total))
        return metrics


def rounds_to_target(rounds: Sequence[int], values: Sequence[float | None], target: float) -> int | None:
    """The first round whose value reaches ``target`` (DaFKD Table 2, FedKF Table VIII); None if never."""
    for r, v in zip(rounds, values):
        if v is not None and not (isinstance(v, float) and math.isnan(v)) and v >= target:
            return int(r)
    return None
