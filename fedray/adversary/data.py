"""The data attacks: a malicious client's training data, poisoned where the client runs (``adversary.attack`` =
``label_flip`` or ``backdoor``; docs/adversaries.md).

- ``label_flip`` (Fang et al., USENIX Security 2020: l -> C - 1 - l; Tolpegin et al., ESORICS 2020: one class onto
  another): every label of the client changed, ``flip=reverse`` y -> C - 1 - y, ``flip=map`` y -> flip_map[y],
  ``flip=random`` y -> a uniformly drawn other label, one draw a sample.
- ``backdoor`` (BadNets, Gu et al. 2017; in federated learning Bagdasaryan et al., AISTATS 2020): a share
  ``poison_fraction`` of the client's samples, round(fraction x n) and at least one, get the trigger
  (:func:`stamp`) and the label ``adversary.target``. The same :func:`stamp` makes the triggered test set of
  ``eval/attack_success`` (:class:`Backdoor`, :mod:`fedray.evaluation`).

A client's data is poisoned once: every draw comes from the stream of (run seed, "adversary", client id), so its
data is the same every round, on every worker and runtime, trained alone or batched with others, and the label
counts the server is told (``client_label_counts``) are those of the poisoned labels. Only training data is
poisoned: the clients' local test splits and the global test set stay as they are (what the model is judged on).
Knows no method and no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedray.adversary import malicious_clients
from fedray.adversary.config import DATA_ATTACKS, AdversaryConfig
from fedray.seeding import derive_rng

if TYPE_CHECKING:
    from fedray.config import ExperimentConfig


def extremes(dtype: np.dtype) -> tuple[float, float]:
    """(brightest, darkest) pixel value of images of ``dtype``: its integer range (uint8: 255 and 0, the range
    :func:`fedray.data.federated.to_float` maps to 0..1 before normalising), else 1 and 0 for float images."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return info.max, info.min
    return 1.0, 0.0


def stamp(x: np.ndarray, size: int) -> np.ndarray:
    """``x`` (..., H, W) with the backdoor trigger: its bottom-right ``size`` x ``size`` square, on every channel,
    a checkerboard whose pixel (i, j) of the square is the brightest value where i + j is even and the darkest
    where it is odd (a pattern no natural image has, the BadNets trigger's role). A copy; ``x`` is unchanged."""
    out = np.array(x, copy=True)
    bright, dark = extremes(out.dtype)
    i, j = np.indices((size, size))
    out[..., -size:, -size:] = np.where((i + j) % 2 == 0, bright, dark).astype(out.dtype)
    return out


@dataclass(frozen=True)
class Backdoor:
    """The run's backdoor as evaluation needs it: the target class and the trigger's side."""

    target: int
    trigger_size: int

    def stamp(self, x: np.ndarray) -> np.ndarray:
        return stamp(x, self.trigger_size)


def backdoor(cfg: "ExperimentConfig") -> Backdoor | None:
    """The backdoor of ``cfg`` (``adversary.attack=backdoor``), else None."""
    adv = cfg.adversary
    return Backdoor(adv.target, adv.trigger_size) if adv.attack == "backdoor" else None


def poisoned_labels(adv: AdversaryConfig, seed: int, client_id: int, y: np.ndarray,
                    num_classes: int) -> tuple[np.ndarray, np.ndarray | None]:
    """A malicious client's labels under the data attack ``adv`` (a new array; ``y`` is unchanged) and, for
    ``backdoor``, the rows of its data that get the trigger (sorted; else None). Drawn from the stream of (run
    ``seed``, "adversary", ``client_id``) alone, so the same wherever and whenever the client runs."""
    rng = derive_rng(seed, "adversary", client_id)
    y = np.array(y, copy=True)
    if adv.attack == "label_flip":
        if adv.flip == "reverse":
            return (num_classes - 1 - y).astype(y.dtype), None
        if adv.flip == "map":
            return np.asarray(adv.flip_map, dtype=y.dtype)[y], None
        # y + s mod C for s uniform in 1..C-1: uniform over the C - 1 other labels
        return ((y + rng.integers(1, num_classes, size=len(y))) % num_classes).astype(y.dtype), None
    if adv.attack == "backdoor":
        n = len(y)
        k = min(n, max(1, round(adv.poison_fraction * n))) if n else 0
        rows = np.sort(rng.choice(n, size=k, replace=False))
        y[rows] = adv.target
        return y, rows
    return y, None


class DataAttack:
    """A run's data attack: which clients it poisons, and their data as they hold it. Built once from the config
    (a worker, the server's set-up). The poisoned arrays are not kept, which would hold a second copy of every
    malicious client's images a worker serves: poisoning a client again each round (its seeded draws, the copy,
    the stamps) measured 0.1-0.3 ms for 600 28x28 images here, against the milliseconds of its local training."""

    def __init__(self, cfg: "ExperimentConfig", num_classes: int):
        self.adv, self.seed, self.num_classes = cfg.adversary, cfg.seed, num_classes
        self.clients = malicious_clients(cfg)

    def labels(self, client_id: int, y: np.ndarray) -> np.ndarray:
        """Client ``client_id``'s training labels as it holds them (``y`` itself for an honest client)."""
        if client_id not in self.clients:
            return y
        return poisoned_labels(self.adv, self.seed, client_id, y, self.num_classes)[0]

    def data(self, client_id: int, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Client ``client_id``'s training images and labels as it holds them: ``x`` and ``y`` themselves for an
        honest client, else poisoned copies (the arrays handed in are never written to)."""
        if client_id not in self.clients:
            return x, y
        y, rows = poisoned_labels(self.adv, self.seed, client_id, y, self.num_classes)
        if rows is not None and len(rows):
            x = np.array(x, copy=True)
            x[rows] = stamp(x[rows], self.adv.trigger_size)
        return x, y


def data_attack(cfg: "ExperimentConfig", num_classes: int) -> DataAttack | None:
    """The data attack of ``cfg``, or None when its attack (if any) leaves the clients' data alone."""
    return DataAttack(cfg, num_classes) if cfg.adversary.attack in DATA_ATTACKS else None


__all__ = ["Backdoor", "DataAttack", "backdoor", "data_attack", "extremes", "poisoned_labels", "stamp"]
