"""``FederatedData``: one dataset, partitioned over clients, each client split 80/20 into train/test.

The images are stored once as uint8 (clients hold index arrays into them), so 10,000 clients cost one
copy of the dataset plus their indices. Normalisation happens per batch with :func:`to_float`.

Per-client 80/20 split: FedKF Sec. VI-A (AMP, FM and WLP are computed on the client test splits; see
ALGORITHMS.md "Shared conventions"). The global test split is the dataset's own test set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedray.config import DataConfig
from fedray.data.datasets import load_dataset
from fedray.data.partition import partition_dirichlet, partition_iid, partition_shards, split_train_test

# Fixed purpose ids for the seed streams, so adding a random draw elsewhere never shifts the partition.
PARTITION_STREAM = 1
SPLIT_STREAM = 2


@dataclass
class FederatedData:
    """A partitioned dataset. ``client_train[k]`` / ``client_test[k]`` index into ``train_x``."""

    dataset: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    client_train: list[np.ndarray]
    client_test: list[np.ndarray]
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)

    def client_sizes(self) -> np.ndarray:
        """Training sample count of each client (the |D_k| weights of FedAvg-style averaging)."""
        return np.array([len(idx) for idx in self.client_train], dtype=np.int64)

    def client_test_sizes(self) -> np.ndarray:
        """Local test sample count of each client."""
        return np.array([len(idx) for idx in self.client_test], dtype=np.int64)

    def label_counts(self) -> np.ndarray:
        """(num_clients, num_classes) label counts over each client's train and test samples."""
        k = self.num_clients
        sizes = self.client_sizes() + self.client_test_sizes()
        owner = np.repeat(np.arange(k, dtype=np.int64), sizes)
        if k == 0 or sizes.sum() == 0:
            return np.zeros((k, self.num_classes), dtype=np.int64)
        # Interleave train, test per client so ``owner`` lines up with the concatenation.
        idx = np.concatenate([part for pair in zip(self.client_train, self.client_test) for part in pair])
        flat = owner * self.num_classes + self.train_y[idx]
        return np.bincount(flat, minlength=k * self.num_classes).reshape(k, self.num_classes)


def partition(cfg: DataConfig, labels: np.ndarray, seed: int) -> list[np.ndarray]:
    """Partition ``labels`` over ``cfg.num_clients`` clients as ``cfg.partition`` says."""
    rng = np.random.default_rng([seed, PARTITION_STREAM])
    if cfg.partition == "dirichlet":
        return partition_dirichlet(labels, cfg.num_clients, cfg.alpha, cfg.min_samples, rng)
    if cfg.partition == "iid":
        return partition_iid(labels, cfg.num_clients, rng)
    return partition_shards(labels, cfg.num_clients, cfg.shards_per_client, rng)


def build_federated_data(cfg: DataConfig, seed: int) -> FederatedData:
    """Load ``cfg.dataset`` and partition its training split; same (cfg, seed) -> identical arrays."""
    raw = load_dataset(cfg, seed)
    parts = partition(cfg, raw.train_y, seed)
    rng = np.random.default_rng([seed, SPLIT_STREAM])
    splits = [split_train_test(idx, cfg.test_fraction, rng) for idx in parts]
    return FederatedData(
        dataset=raw.name,
        train_x=raw.train_x,
        train_y=raw.train_y,
        test_x=raw.test_x,
        test_y=raw.test_y,
        client_train=[tr for tr, _ in splits],
        client_test=[te for _, te in splits],
        num_classes=raw.num_classes,
        mean=tuple(raw.mean),
        std=tuple(raw.std),
    )


def to_float(x_uint8: torch.Tensor, mean, std) -> torch.Tensor:
    """``(x / 255 - mean[c]) / std[c]`` as float32, on ``x``'s device; ``x`` is (B, C, H, W) or (C, H, W)."""
    x = x_uint8.to(torch.float32, copy=True).div_(255.0)  # copy: never modify a float input in place
    m = torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    return x.sub_(m).div_(s)
