"""Evaluation metrics: global top-1 accuracy and FedKF's AMP / FM / WLP (Def. 1-3), rounds to target.

- ``eval/accuracy``: the global model's top-1 accuracy on the dataset's global test split (DaFKD Table 1);
  for personalised methods (every client its own model), the mean over clients of their own model's
  accuracy on the global test split.
- ``eval/amp``: sum_k |D_k|/|D| acc_k over every client's local 20% test split (FedKF Def. 1), which equals
  total correct / total test samples.
- ``eval/fm``: the population variance of acc_k over clients (FedKF Def. 2; fairness, lower is fairer).
- ``eval/wlp``: min_k acc_k (FedKF Def. 3; worst local performance).

For personalised methods acc_k is client k's own model on its own test split.

Each evaluation's per-client figures (acc_k, the mean cross-entropy on the split, its size) are also kept
per client (:class:`ClientScores`, the run's ``clients.parquet``), so AMP, FM and WLP can be recomputed, and
followed client by client, after the run.

- ``val/accuracy`` (with ``data.val_per_class``): the same as ``eval/accuracy`` on the validation set held
  out of the training set, the figure to select hyperparameters by; the test set stays for reporting.
- ``eval/attack_success`` (with ``adversary.attack=backdoor``): the share of the global test set's images whose
  true class is not the target that, with the trigger stamped, the global model classifies as the target
  (Bagdasaryan et al., AISTATS 2020's backdoor accuracy); for personalised methods, the mean over the honest
  clients of their own model's share (a malicious client's own model is the attacker's, not a victim).

All are fractions in 0..1; FM is in fraction^2 units (FedKF's tables print it x 10^3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedray.adversary.data import Backdoor
from fedray.data.federated import FederatedData, to_float
from fedray.models.base import channels_last_if_faster


def client_metrics(correct: np.ndarray, total: np.ndarray) -> dict[str, float]:
    """AMP, FM and WLP from per-client counts of correct predictions and test samples."""
    has = total > 0
    acc = correct[has] / total[has]
    return {
        "eval/amp": float(correct.sum() / max(total.sum(), 1)),
        "eval/fm": float(np.var(acc)) if acc.size else math.nan,
        "eval/wlp": float(acc.min()) if acc.size else math.nan,
    }


@dataclass
class ClientScores:
    """One evaluation's figures per evaluated client: every client with a nonempty local test split (one
    without has no acc_k, and AMP / FM / WLP leave it out too), in client-id order. ``loss_sum`` is the
    cross-entropy summed over the split, so that the mean is exact however the samples were batched.
    Personalised methods also give each client's own model on the global test set (``global_correct`` of
    ``global_samples``) and on the validation set when there is one."""

    client: np.ndarray
    correct: np.ndarray
    samples: np.ndarray
    loss_sum: np.ndarray
    global_correct: np.ndarray | None = None
    global_samples: np.ndarray | None = None
    val_correct: np.ndarray | None = None
    val_samples: np.ndarray | None = None

    def columns(self) -> dict[str, np.ndarray]:
        """The columns of ``clients.parquet`` (without ``round``): ``accuracy`` is acc_k exactly as
        :func:`client_metrics` computes it, so FM and WLP recomputed from the column are the logged ones."""
        samples = self.samples.astype(np.int64)
        cols = {"client": self.client.astype(np.int64), "accuracy": self.correct / samples,
                "loss": self.loss_sum / samples, "correct": np.rint(self.correct).astype(np.int64),
                "samples": samples}
        if self.global_correct is not None:
            cols["global_accuracy"] = self.global_correct / np.maximum(self.global_samples, 1)
        if self.val_correct is not None and self.val_samples.any():
            cols["val_accuracy"] = self.val_correct / np.maximum(self.val_samples, 1)
        return cols


def personal_metrics(counts: np.ndarray) -> dict[str, float]:
    """``eval/*`` of personalised methods from per-client rows (correct on own test split, own test split
    size, correct on the global test set, its size, correct on the validation set, its size): AMP / FM / WLP
    on the clients' own test splits, ``eval/accuracy`` = the mean over clients of their own model's
    global-test accuracy, and ``val/accuracy`` the same on the validation set when there is one."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1, 6)
    metrics = {"eval/accuracy": float(np.mean(counts[:, 2] / np.maximum(counts[:, 3], 1))) if len(counts)
               else math.nan}
    metrics.update(client_metrics(counts[:, 0], counts[:, 1]))
    if len(counts) and counts[:, 5].any():
        metrics["val/accuracy"] = float(np.mean(counts[:, 4] / np.maximum(counts[:, 5], 1)))
    return metrics


def personal_attack_success(counts: np.ndarray) -> float:
    """``eval/attack_success`` of a personalised method from per-client rows (triggered test images the client's
    own model classifies as the target, triggered test images): the mean of the clients' shares over the rows
    scored (the honest clients: a malicious client's row is (0, 0)); NaN when none is."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1, 2)
    scored = counts[counts[:, 1] > 0]
    return float(np.mean(scored[:, 0] / scored[:, 1])) if len(scored) else math.nan


def personal_scores(counts: np.ndarray, loss_sums: np.ndarray, clients: np.ndarray | None = None) -> ClientScores:
    """:class:`ClientScores` of a personalised evaluation from the rows of :func:`personal_metrics` (the clients
    ``clients``, in order: by default every registered client in id order) and each client's summed cross-entropy on
    its own test split."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1, 6)
    has = counts[:, 1] > 0
    own = counts[has]
    ids = np.arange(len(counts)) if clients is None else np.asarray(clients, dtype=np.int64)
    return ClientScores(client=ids[np.flatnonzero(has)], correct=own[:, 0], samples=own[:, 1].astype(np.int64),
                        loss_sum=np.asarray(loss_sums, dtype=np.float64)[has], global_correct=own[:, 2],
                        global_samples=own[:, 3], val_correct=own[:, 4], val_samples=own[:, 5])


#: On a CPU the evaluator forwards at most this many samples at once (``federation.eval_batch_size`` still
#: caps it). Measured on one thread (AMD EPYC, 2 MiB L2): LeNet-5 and ResNet-8 score 22k Fashion-MNIST
#: images as fast at 128-512 as at any size, and 1.4x slower at 1024, whose activations leave the cache.
CPU_EVAL_BATCH = 512


def eval_layout(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` (an evaluation-only copy: it is changed in place) in the memory layout its inference is
    fastest in on ``device``: on a CPU, channels-last where that measured faster (convolutional models without
    GroupNorm, :func:`fedray.models.base.channels_last_if_faster`). Inference alone, one thread (Intel Xeon,
    2,048 images of batch 512): LeNet-5 1.65x, VGG-small 1.63x, MobileNetV3-Small 1.42x, ResNet-11 1.42x,
    ResNet-8x4 1.39x, ResNet-8-BN and ResNet-20 1.27x, ResNet-18 1.11x faster; FedKF's GroupNorm ResNet-8
    0.63x, so it stays as it is, as do models without convolutions and every GPU. Logits agree to float
    rounding (<= 3e-5 in those runs; no prediction changed). Training keeps the default layout unless
    ``runtime.cpu_channels_last``: its float rounding is what the recorded results and the
    vectorised-vs-sequential tests pin."""
    return channels_last_if_faster(model) if device.type == "cpu" else model


#: Normalised float copies of the evaluation images stay on the evaluator's device up to this many bytes
#: (Fashion-MNIST's 10k test + 12k client-test images: 69 MB); beyond it, the rest is converted from the
#: uint8 copy per batch, as every batch was before.
EVAL_CACHE_BYTES = 256 << 20


class EvalIndex:
    """Where each sample of the evaluation set comes from: the global test set first, then the validation
    set (if any), then every client's local test split in client-id order, then, under a backdoor, the triggered
    test set (the global test images whose class is not the target, with the trigger, labelled the target: a
    "right" prediction there is the attack's success). Holds indices only (the driver uses it to turn per-sample
    results from the Ray workers into metrics, without a copy of the images)."""

    def __init__(self, data: FederatedData, backdoor: Backdoor | None = None, members: np.ndarray | None = None):
        #: the clients whose local test splits are scored, in order: every client, or (clients made on demand) the
        #: run's sample of them (``data.eval_clients``)
        self.clients = np.asarray(data.evaluated_clients(), dtype=np.int64)
        self.num_test = len(data.test_y)
        self.num_val = data.num_val
        self.num_clients = len(self.clients)
        sizes = data.client_test_sizes()[self.clients] if self.num_clients else np.zeros(0, np.int64)
        self.client_of = np.repeat(np.arange(self.num_clients), sizes)
        #: the validation set is samples num_test:val_stop of the evaluation set
        self.val_stop = self.num_test + self.num_val
        #: client k's test split is samples local_start[k]:local_start[k+1] of the evaluation set
        self.local_start = self.val_stop + np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self.local_stop = int(self.local_start[-1])
        #: the triggered test set: these rows of the global test set, samples local_stop:size of the evaluation set
        self.triggered = (None if backdoor is None
                          else np.flatnonzero(np.asarray(data.test_y) != backdoor.target).astype(np.int64))
        self.target = None if backdoor is None else backdoor.target
        self.trigger_stop = self.local_stop + (0 if self.triggered is None else len(self.triggered))
        #: the membership audit's members (rows of data.train_x the clients train on), samples trigger_stop:size
        self.members = members
        self.size = self.trigger_stop + (0 if members is None else len(members))
        if members is not None:  # each member's client, for the audit of personal models
            owner = np.full(len(data.train_y), -1, dtype=np.int64)
            for k, rows in enumerate(data.client_train):
                owner[np.asarray(rows, dtype=np.int64)] = k
            self.member_client = owner[members]
        # Multi-domain data: the global test set's accuracy per domain too (eval/acc_<domain>)
        self.test_domain = None if data.test_domain is None else np.asarray(data.test_domain)
        self.domains = data.domains

    def chunks(self, batch_size: int) -> list[tuple[int, int]]:
        """The fixed batches (start, stop) in which the evaluation set is scored: the global test set, the
        validation set, the client splits, then the triggered test set, each cut every ``batch_size`` samples.
        Fixed so that however the batches are spread over processes, every sample is scored in the same batch and
        gets the same logits."""
        return (_ranges(0, self.num_test, batch_size) + _ranges(self.num_test, self.val_stop, batch_size)
                + _ranges(self.val_stop, self.local_stop, batch_size) + self.triggered_chunks(batch_size)
                + _ranges(self.trigger_stop, self.size, batch_size))

    def triggered_chunks(self, batch_size: int) -> list[tuple[int, int]]:
        """The fixed batches of the triggered test set (none without a backdoor)."""
        return _ranges(self.local_stop, self.trigger_stop, batch_size)

    def membership(self, loss: np.ndarray) -> dict[str, float]:
        """``diag/mia_auc`` from every sample's cross-entropy: the members' against the global test set's
        (:mod:`fedray.privacy.audit`); none without an audit."""
        if self.members is None:
            return {}
        from fedray.privacy.audit import membership_auc

        return {"diag/mia_auc": membership_auc(loss[self.trigger_stop:self.size], loss[:self.num_test])}

    def metrics(self, ok: np.ndarray) -> dict[str, float]:
        """``eval/accuracy`` (and ``eval/acc_<domain>``), AMP, FM and WLP, ``val/accuracy`` with a validation set
        and ``eval/attack_success`` with a backdoor, from every sample's correctness."""
        glob, local = ok[: self.num_test], ok[self.val_stop : self.local_stop]
        metrics = {"eval/accuracy": float(glob.mean())}
        if self.num_val:
            metrics["val/accuracy"] = float(ok[self.num_test : self.val_stop].mean())
        if self.test_domain is not None:
            for d in np.unique(self.test_domain):
                metrics[f"eval/acc_{self.domains[d]}"] = float(glob[self.test_domain == d].mean())
        correct = np.bincount(self.client_of, weights=local, minlength=self.num_clients)
        total = np.bincount(self.client_of, minlength=self.num_clients)
        metrics.update(client_metrics(correct, total))
        if self.triggered is not None:  # predicted the target on a triggered image of another class
            hit = ok[self.local_stop : self.trigger_stop]
            metrics["eval/attack_success"] = float(hit.mean()) if hit.size else math.nan
        return metrics

    def client_scores(self, ok: np.ndarray, loss: np.ndarray) -> ClientScores:
        """Per-client figures from every sample's correctness and cross-entropy (:meth:`Evaluator.score`):
        the counts :meth:`metrics` computes AMP / FM / WLP from, and the summed loss (float64 sums of the
        float32 per-sample losses, in sample order: the same wherever the batches were scored)."""
        local = ok[self.val_stop : self.local_stop]
        correct = np.bincount(self.client_of, weights=local, minlength=self.num_clients)
        total = np.bincount(self.client_of, minlength=self.num_clients)
        loss_sum = np.bincount(self.client_of, weights=np.asarray(loss[self.val_stop : self.local_stop],
                                                                  dtype=np.float64),
                               minlength=self.num_clients)
        has = total > 0
        return ClientScores(client=self.clients[np.flatnonzero(has)], correct=correct[has], samples=total[has],
                            loss_sum=loss_sum[has])

    def merged(self, parts: list[dict[str, list]]) -> tuple[dict[str, dict[str, float]], ClientScores | None]:
        """Each scored model's figures (:meth:`metrics`; the global model's, suffix "", with :meth:`membership`) and
        the global model's per-client ones, from the parts of an evaluation spread over processes (each a
        :meth:`fedray.runtime.core.ClientWorkerCore.evaluate_global`: per model, its batches' (start, stop,
        correct, loss)); the parts' batches together cover the evaluation set once."""
        scored, clients = {}, None
        for suffix in parts[0]:
            ok, loss = np.zeros(self.size, dtype=bool), np.zeros(self.size, dtype=np.float32)
            for start, stop, correct, ce in (row for part in parts for row in part[suffix]):
                ok[start:stop] = correct
                if suffix == "":  # only the global model's losses are sent (the others' are None)
                    loss[start:stop] = ce
            scored[suffix] = self.metrics(ok)
            if suffix == "":
                scored[suffix].update(self.membership(loss))
                clients = self.client_scores(ok, loss)
        return scored, clients


def local_test_set(data: FederatedData, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The local test splits of ``clients``, in order, as one array of images and one of labels
    (:meth:`~fedray.data.federated.FederatedData.client_test_data`: made on demand, one derivation a client)."""
    made = [data.client_test_data(int(k)) for k in clients]
    if not made:
        return data.train_x[:0], data.train_y[:0]
    return np.concatenate([x for x, _ in made]), np.concatenate([y for _, y in made])


def _ranges(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(s, min(s + step, hi)) for s in range(lo, hi, step)]


class Evaluator:
    """Evaluates models on the global test set and on the clients' local test splits.

    The client test sets are gathered once into one array with the global test set (see :class:`EvalIndex`),
    so evaluating 10,000 clients costs one batched pass, not 10,000 small ones. Each batch's normalised
    float tensor is kept on the device after its first use (up to ``cache_bytes``): a run scores the same
    images every round, and a personalised evaluation scores the global test set once per client.
    """

    def __init__(self, data: FederatedData, model: torch.nn.Module | None, device: torch.device, batch_size: int,
                 cache_bytes: int = EVAL_CACHE_BYTES, backdoor: Backdoor | None = None,
                 members: np.ndarray | None = None):
        self.model = model
        self.device = device
        self.batch_size = min(batch_size, CPU_EVAL_BATCH) if device.type == "cpu" else batch_size
        self.mean, self.std = data.mean, data.std
        self.index = EvalIndex(data, backdoor, members)
        # One uint8 copy (also off Ray's read-only object store, which torch warns about).
        val_x, val_y = ([np.asarray(data.val_x)], [np.asarray(data.val_y)]) if data.num_val else ([], [])
        trig_x, trig_y = [], []
        if backdoor is not None:  # the triggered test set, labelled the target (stamped here, as in training)
            trig_x = [backdoor.stamp(np.asarray(data.test_x)[self.index.triggered])]
            trig_y = [np.full(len(self.index.triggered), backdoor.target, dtype=np.asarray(data.test_y).dtype)]
        mem_x, mem_y = ([data.train_x[members]], [data.train_y[members]]) if members is not None else ([], [])
        local_x, local_y = local_test_set(data, self.index.clients)
        self.x = np.concatenate([np.asarray(data.test_x), *val_x, local_x, *trig_x, *mem_x])
        self.y = np.concatenate([np.asarray(data.test_y), *val_y, local_y, *trig_y, *mem_y])
        self.cache_bytes = cache_bytes
        self._floats: dict[tuple[int, int], torch.Tensor] = {}
        self._cached = 0

    @property
    def num_clients(self) -> int:
        return self.index.num_clients

    def _batch(self, start: int, stop: int) -> torch.Tensor:
        """Samples start:stop as normalised floats on the device, from the cache when there."""
        x = self._floats.get((start, stop))
        if x is None:
            x = to_float(torch.from_numpy(self.x[start:stop]).to(self.device), self.mean, self.std)
            if self._cached + x.nbytes <= self.cache_bytes:
                self._floats[(start, stop)] = x
                self._cached += x.nbytes
        return x

    @torch.inference_mode()
    def score(self, model: torch.nn.Module, ranges: list[tuple[int, int]],
              losses: bool = True) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """For each (start, stop) range: whether ``model`` (in eval mode) predicts each sample right, and with
        ``losses`` each sample's cross-entropy (float32; one log-softmax over logits already computed, next
        to nothing beside the forward pass). The predictions are those of :meth:`correct`."""
        out = []
        for start, stop in ranges:
            logits = model(self._batch(start, stop))
            ok = logits.argmax(1).cpu().numpy() == self.y[start:stop]
            ce = None
            if losses:
                y = torch.from_numpy(np.asarray(self.y[start:stop], dtype=np.int64)).to(logits.device)
                ce = F.cross_entropy(logits.float(), y, reduction="none").cpu().numpy()
            out.append((ok, ce))
        return out

    def correct(self, model: torch.nn.Module, ranges: list[tuple[int, int]]) -> list[np.ndarray]:
        """Whether ``model`` (in eval mode) predicts each sample of each (start, stop) range right."""
        return [ok for ok, _ in self.score(model, ranges, losses=False)]

    def chunks(self) -> list[tuple[int, int]]:
        return self.index.chunks(self.batch_size)

    def personal_counts(self, model: torch.nn.Module, client_id: int) -> tuple[int, ...]:
        """Client ``client_id``'s own ``model`` (weights loaded): (correct, samples) on its own test split,
        on the global test set, then on the validation set -- one row of :func:`personal_metrics`."""
        return self.personal_scores(model, client_id)[0]

    def personal_scores(self, model: torch.nn.Module, client_id: int) -> tuple[tuple[int, ...], float]:
        """:meth:`personal_counts`' row, and the cross-entropy of ``model`` summed over the client's own test
        split (scored in the same fixed batches on every runtime, so the same float)."""
        model.eval()
        at = int(np.searchsorted(self.index.clients, client_id))  # its place among the clients scored
        assert at < self.index.num_clients and self.index.clients[at] == client_id, "a client not evaluated"
        lo, hi = int(self.index.local_start[at]), int(self.index.local_start[at + 1])
        own = self.score(model, _ranges(lo, hi, self.batch_size))
        row = [int(sum(ok.sum() for ok, _ in own)), hi - lo]
        for start, stop in ((0, self.index.num_test), (self.index.num_test, self.index.val_stop)):
            row += [int(sum(o.sum() for o in self.correct(model, _ranges(start, stop, self.batch_size)))),
                    stop - start]
        loss_sum = float(np.concatenate([ce for _, ce in own]).astype(np.float64).sum()) if own else 0.0
        return tuple(row), loss_sum

    def membership_pairs(self, model: torch.nn.Module, client_id: int) -> tuple[float, float]:
        """The audit of client ``client_id``'s own ``model`` (:func:`fedray.privacy.audit.membership_u`): its members
        against the global test set; (0, 0) without an audit or without members of its own."""
        if self.index.members is None:
            return 0.0, 0.0
        from fedray.privacy.audit import membership_u

        own = self.index.trigger_stop + np.flatnonzero(self.index.member_client == client_id)
        if own.size == 0:
            return 0.0, 0.0
        model.eval()
        test = np.concatenate([ce for _, ce in self.score(model, _ranges(0, self.index.num_test, self.batch_size))])
        with torch.inference_mode():
            x = to_float(torch.from_numpy(self.x[own]).to(self.device), self.mean, self.std)
            y = torch.from_numpy(np.asarray(self.y[own], dtype=np.int64)).to(self.device)
            member = F.cross_entropy(model(x).float(), y, reduction="none").cpu().numpy()
        return membership_u(member, test)

    def attack_counts(self, model: torch.nn.Module) -> tuple[int, int]:
        """(triggered test images ``model`` classifies as the backdoor's target, triggered test images); (0, 0)
        without a backdoor."""
        ranges = self.index.triggered_chunks(self.batch_size)
        return (int(sum(ok.sum() for ok in self.correct(model.eval(), ranges))),
                self.index.trigger_stop - self.index.local_stop)

    def load(self, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        assert self.model is not None, "scoring a global model: build the Evaluator with one"
        self.model.load_state_dict(weights)
        return self.model.eval()

    def evaluate(self, weights: dict[str, torch.Tensor]) -> dict[str, float]:
        """``eval/*`` of the global model ``weights`` on the whole evaluation set."""
        ok = self.correct(self.load(weights), self.chunks())
        return self.index.metrics(np.concatenate(ok) if ok else np.zeros(0, bool))

    def evaluation(self, weights: dict[str, torch.Tensor]) -> tuple[dict[str, float], ClientScores]:
        """:meth:`evaluate`'s figures and the per-client ones (:meth:`EvalIndex.client_scores`)."""
        scored = self.score(self.load(weights), self.chunks())
        ok = np.concatenate([o for o, _ in scored]) if scored else np.zeros(0, bool)
        ce = np.concatenate([c for _, c in scored]) if scored else np.zeros(0, np.float32)
        return {**self.index.metrics(ok), **self.index.membership(ce)}, self.index.client_scores(ok, ce)


def rounds_to_target(rounds: Sequence[int], values: Sequence[float | None], target: float) -> int | None:
    """The first round whose value reaches ``target`` (DaFKD Table 2, FedKF Table VIII); None if never."""
    for r, v in zip(rounds, values):
        if v is not None and not (isinstance(v, float) and math.isnan(v)) and v >= target:
            return int(r)
    return None
