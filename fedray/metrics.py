"""Evaluation metrics: global top-1 accuracy and FedKF's AMP / FM / WLP (Def. 1-3), rounds to target.

- ``eval/accuracy``: the global model's top-1 accuracy on the dataset's global test split (DaFKD Table 1);
  for personalised methods (every client its own model), the mean over clients of their own model's
  accuracy on the global test split.
- ``eval/amp``: sum_k |D_k|/|D| acc_k over every client's local 20% test split (FedKF Def. 1), which equals
  total correct / total test samples.
- ``eval/fm``: the population variance of acc_k over clients (FedKF Def. 2; fairness, lower is fairer).
- ``eval/wlp``: min_k acc_k (FedKF Def. 3; worst local performance).

For personalised methods acc_k is client k's own model on its own test split.

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


def personal_metrics(counts: np.ndarray) -> dict[str, float]:
    """``eval/*`` of personalised methods from per-client rows (correct on own test split, own test split
    size, correct on the global test set, global test set size): AMP / FM / WLP on the clients' own test
    splits, and ``eval/accuracy`` = the mean over clients of their own model's global-test accuracy."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1, 4)
    metrics = {"eval/accuracy": float(np.mean(counts[:, 2] / np.maximum(counts[:, 3], 1))) if len(counts)
               else math.nan}
    metrics.update(client_metrics(counts[:, 0], counts[:, 1]))
    return metrics


class Evaluator:
    """Evaluates models on the global test set and on the clients' local test splits.

    The client test sets are gathered once into one array (with each sample's client id) so evaluating
    10,000 clients costs one batched pass, not 10,000 small ones.
    """

    def __init__(self, data: FederatedData, model: torch.nn.Module | None, device: torch.device, batch_size: int):
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
        self.local_start = np.concatenate(([0], np.cumsum([len(i) for i in idx]))).astype(np.int64)
        # Multi-domain data: the global test set's accuracy per domain too (eval/acc_<domain>)
        self.test_domain = None if data.test_domain is None else np.asarray(data.test_domain)
        self.domains = data.domains

    @torch.inference_mode()
    def _correct(self, x: np.ndarray, y: np.ndarray, model: torch.nn.Module | None = None) -> np.ndarray:
        model = model or self.model
        out = np.empty(len(y), dtype=bool)
        for s in range(0, len(y), self.batch_size):
            xb = torch.from_numpy(x[s : s + self.batch_size]).to(self.device)
            pred = model(to_float(xb, self.mean, self.std)).argmax(1).cpu().numpy()
            out[s : s + self.batch_size] = pred == y[s : s + self.batch_size]
        return out

    def personal_counts(self, model: torch.nn.Module, client_id: int) -> tuple[int, int, int, int]:
        """Client ``client_id``'s own ``model`` (weights loaded): (correct, samples) on its own test split,
        then on the global test set -- one row of :func:`personal_metrics`."""
        model.eval()
        lo, hi = self.local_start[client_id], self.local_start[client_id + 1]
        own = self._correct(self.local_x[lo:hi], self.local_y[lo:hi], model)
        glob = self._correct(self.test_x, self.test_y, model)
        return int(own.sum()), int(hi - lo), int(glob.sum()), len(glob)

    def evaluate(self, weights: dict[str, torch.Tensor]) -> dict[str, float]:
        assert self.model is not None, "evaluate() scores a global model: build the Evaluator with one"
        self.model.load_state_dict(weights)
        self.model.eval()
        glob = self._correct(self.test_x, self.test_y)
        metrics = {"eval/accuracy": float(glob.mean())}
        if self.test_domain is not None:
            for d in np.unique(self.test_domain):
                metrics[f"eval/acc_{self.domains[d]}"] = float(glob[self.test_domain == d].mean())
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
