"""``FederatedData``: one dataset, partitioned over clients, each client split 80/20 into train/test,
plus the server's own data and, for multi-domain datasets, which domain every sample comes from.

The images are stored once as uint8 (clients hold index arrays into them), so 10,000 clients cost one
copy of the dataset plus their indices. Normalisation happens per batch with :func:`to_float`.

Per-client 80/20 split: FedKF Sec. VI-A (AMP, FM and WLP are computed on the client test splits). The
global test split is the dataset's own test set; for a multi-domain dataset, the test shares of the
client domains (the server's domain excluded).

Validation set (``data.val_per_class``): that many samples of every class taken out of the training set
before partitioning, in no client's indices and never shown to a method; the global model is scored on it as
``val/accuracy``, the figure a sweep selects hyperparameters by so that the test set stays for reporting.

Server data (``data.server_data``), never in any client's indices unless ``keep_in_training`` says so:

- ``holdout``: ``per_class`` samples of every class taken out of the training set before partitioning,
  labelled by default (FedCD Sec. V-A: a 50-per-class validation set sampled from the training set); with
  ``keep_in_training`` copied instead, the partition unchanged (DaFKD's FedDF proxy: unlabelled training samples).
- ``domain``: the training images of one domain of a multi-domain dataset, unlabelled by default
  (FedD3A Sec. 3-4: the server's public unlabelled data comes from its own domain, which has no clients).

Multi-domain partitions (FedD3A Sec. 4): ``domain`` gives each client domain to one client (cross-silo);
``domain_dirichlet`` splits each client domain over ``clients_per_domain`` clients by the Dirichlet label
partition (cross-device). The label partitions (``dirichlet``, ``iid``, ``shards``) pool the client
domains' images.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from fedray.config import DataConfig
from fedray.data.datasets import canonical
from fedray.data.domains import is_multi_domain
from fedray.data.loading import load_dataset, load_domains
from fedray.data.partition import (
    partition_by_domain,
    partition_dirichlet,
    partition_domain_dirichlet,
    partition_iid,
    partition_shards,
    select_holdout,
    split_train_test,
)
from fedray.errors import DataError

# Fixed purpose ids for the seed streams, so adding a random draw elsewhere never shifts the partition.
PARTITION_STREAM = 1
SPLIT_STREAM = 2
SERVER_STREAM = 3
VALIDATION_STREAM = 4


@dataclass
class ServerData:
    """Data held by the server: uint8 NCHW images and their int64 labels.

    ``y`` is always stored because simulation-only diagnostics may score against it; ``labelled`` says
    whether a method may use it (:meth:`visible_y`). ``domain`` names the server's domain (kind=domain),
    else None.
    """

    x: np.ndarray
    y: np.ndarray
    labelled: bool
    domain: str | None = None

    def __len__(self) -> int:
        return len(self.y)

    def visible_y(self) -> np.ndarray | None:
        """The labels a method may see: ``y`` when labelled, else None."""
        return self.y if self.labelled else None


@dataclass
class FederatedData:
    """A partitioned dataset. ``client_train[k]`` / ``client_test[k]`` index into ``train_x``.

    ``server`` is the server's own data (None without ``data.server_data``); ``val_x`` / ``val_y`` the
    validation set (empty without ``data.val_per_class``). For a multi-domain dataset,
    ``domains`` lists the run's domains (``data.domains`` order, the server's included), ``train_domain``
    / ``test_domain`` give each training / global-test sample's index into ``domains`` and
    ``client_domain`` each client's domain index (-1 when its samples come from several domains); all
    are empty / None for a single-domain dataset.
    """

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
    server: ServerData | None = None
    domains: tuple[str, ...] = ()
    train_domain: np.ndarray | None = None
    test_domain: np.ndarray | None = None
    client_domain: np.ndarray | None = None
    val_x: np.ndarray | None = None
    val_y: np.ndarray | None = None

    @property
    def num_val(self) -> int:
        """Samples of the validation set (0 without one)."""
        return 0 if self.val_y is None else len(self.val_y)

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

    def partition_digest(self) -> str:
        """A digest (16 hex digits of SHA-256) of every client's train and test index lists, in client order:
        two runs on the same split have the same digest, whatever their method; another seed or partition
        gives another. It names the run's data in MLflow (:func:`fedray.record.tracking.dataset_entity`)."""
        digest = hashlib.sha256()
        for part in (*self.client_train, *self.client_test):
            idx = np.ascontiguousarray(part, dtype=np.int64)
            digest.update(np.int64(len(idx)).tobytes())  # lengths too: [1, 2][3] and [1][2, 3] differ
            digest.update(idx.tobytes())
        return digest.hexdigest()[:16]

    def client_domain_name(self, k: int) -> str | None:
        """Client ``k``'s domain name, "mixed" if its samples span domains, None for single-domain data."""
        if self.client_domain is None:
            return None
        d = int(self.client_domain[k])
        return self.domains[d] if d >= 0 else "mixed"


def partition(
    cfg: DataConfig,
    labels: np.ndarray,
    seed: int,
    domain: np.ndarray | None = None,
    domain_ids=None,
    domain_names=None,
) -> list[np.ndarray]:
    """Partition ``labels`` over clients as ``cfg.partition`` says.

    The label partitions use ``cfg.num_clients``; the domain partitions need ``domain`` (each sample's
    domain id) and ``domain_ids`` (the client domains' ids, in client order) and define the number of
    clients themselves (one, or ``cfg.clients_per_domain``, per domain).
    """
    rng = np.random.default_rng([seed, PARTITION_STREAM])
    if cfg.partition in ("domain", "domain_dirichlet"):
        if domain is None or domain_ids is None:
            raise DataError("data.partition", f"'{cfg.partition}' needs a multi-domain data.dataset")
        if cfg.partition == "domain":
            return partition_by_domain(domain, domain_ids)
        return partition_domain_dirichlet(labels, domain, domain_ids, cfg.clients_per_domain, cfg.alpha,
                                          cfg.min_samples, rng, names=domain_names)
    if cfg.partition == "dirichlet":
        return partition_dirichlet(labels, cfg.num_clients, cfg.alpha, cfg.min_samples, rng)
    if cfg.partition == "iid":
        return partition_iid(labels, cfg.num_clients, rng)
    if cfg.partition == "central":  # one client holds every training sample
        return [np.arange(len(labels), dtype=np.int64)]
    return partition_shards(labels, cfg.num_clients, cfg.shards_per_client, rng)


def _client_domains(parts: list[np.ndarray], train_domain: np.ndarray | None) -> np.ndarray | None:
    """Each client's domain index, or -1 when its samples come from more than one domain."""
    if train_domain is None:
        return None
    out = np.full(len(parts), -1, dtype=np.int64)
    for k, idx in enumerate(parts):
        d = train_domain[idx]
        if len(d) and (d == d[0]).all():
            out[k] = d[0]
    return out


def build_federated_data(cfg: DataConfig, seed: int) -> FederatedData:
    """Load ``cfg.dataset``, set the server's data aside and partition the rest of the training split.

    Same (cfg, seed) -> identical arrays. The server's data never appears in a client's indices.
    """
    labelled = cfg.server_data.is_labelled()
    server = None
    domains: tuple[str, ...] = ()
    train_domain = test_domain = None
    domain_ids: list[int] | None = None
    client_names = None
    if is_multi_domain(cfg.dataset):
        md = load_domains(cfg)
        domains = tuple(md.domains)
        client_names = cfg.client_domains()
        domain_ids = [domains.index(d) for d in client_names]
        raw = md.pooled(client_names)  # the server's domain is in neither the pool nor the global test
        train_domain = np.repeat(np.array(domain_ids, dtype=np.int64),
                                 [len(md.domains[d].train_y) for d in client_names])
        test_domain = np.repeat(np.array(domain_ids, dtype=np.int64),
                                [len(md.domains[d].test_y) for d in client_names])
        sd = cfg.server_domain()
        if sd is not None:
            own = md.domains[sd]
            server = ServerData(own.train_x, own.train_y, labelled, sd)
        md = None  # drop the per-domain copies before the partition's allocations
    else:
        raw = load_dataset(cfg, seed)
    train_x, train_y = raw.train_x, raw.train_y
    if cfg.server_data.kind == "holdout":
        # Its own stream: the holdout does not move when other draws are added, nor they with it.
        held = select_holdout(train_y, cfg.server_data.per_class, raw.num_classes,
                              np.random.default_rng([seed, SERVER_STREAM]))
        domain = None
        if train_domain is not None:
            got = np.unique(train_domain[held])
            domain = domains[int(got[0])] if len(got) == 1 else None
        server = ServerData(canonical(train_x[held], np.uint8), train_y[held], labelled, domain)
        if not cfg.server_data.keep_in_training:
            train_x, train_y, train_domain = _without(held, train_x, train_y, train_domain)
    val_x = val_y = None
    if cfg.val_per_class:
        # After the server's holdout, on its own stream: with data.val_per_class=0 nothing else moves.
        held = select_holdout(train_y, cfg.val_per_class, raw.num_classes,
                              np.random.default_rng([seed, VALIDATION_STREAM]), "data.val_per_class",
                              "for validation")
        val_x, val_y = canonical(train_x[held], np.uint8), train_y[held]
        train_x, train_y, train_domain = _without(held, train_x, train_y, train_domain)
    parts = partition(cfg, train_y, seed, train_domain, domain_ids, client_names)
    rng = np.random.default_rng([seed, SPLIT_STREAM])
    splits = [split_train_test(idx, cfg.test_fraction, rng) for idx in parts]
    return FederatedData(
        dataset=raw.name,
        train_x=train_x,
        train_y=train_y,
        test_x=raw.test_x,
        test_y=raw.test_y,
        client_train=[tr for tr, _ in splits],
        client_test=[te for _, te in splits],
        num_classes=raw.num_classes,
        mean=tuple(raw.mean),
        std=tuple(raw.std),
        server=server,
        domains=domains,
        train_domain=train_domain,
        test_domain=test_domain,
        client_domain=_client_domains(parts, train_domain),
        val_x=val_x,
        val_y=val_y,
    )


def _without(held: np.ndarray, train_x: np.ndarray, train_y: np.ndarray, train_domain: np.ndarray | None):
    """The training arrays with the samples ``held`` removed, so every remaining one belongs to some client."""
    keep = np.ones(len(train_y), dtype=bool)
    keep[held] = False
    return train_x[keep], train_y[keep], None if train_domain is None else train_domain[keep]


@dataclass
class ClientBatches:
    """A client's local mini-batches of a round as rows of its data: step ``s`` trains on ``to_float(x[index[s]])``
    and ``y[index[s]]``. Iterating yields those batches; the vectorised runner instead gathers every client's
    rows of a step in one indexing op (``fedray.vectorized.engine``), so both see the same batches."""

    x: torch.Tensor  # uint8 (N, C, H, W), on the training device
    y: torch.Tensor  # int64 (N,)
    index: list[torch.Tensor]  # per step, int64 rows into x / y, on the host
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __iter__(self):
        if not self.index:
            return
        # every step's rows go to the device in one copy a round, not one a step (see to_device)
        rows = to_device(torch.cat(self.index), self.x.device).split([len(i) for i in self.index])
        for idx in rows:
            yield to_float(self.x[idx], self.mean, self.std), self.y[idx]


def to_float(x_uint8: torch.Tensor, mean, std) -> torch.Tensor:
    """``(x / 255 - mean[c]) / std[c]`` as float32, on ``x``'s device; ``x`` is (B, C, H, W) or (C, H, W)."""
    x = x_uint8.to(torch.float32, copy=True).div_(255.0)  # copy: never modify a float input in place
    m, s = _channel_stats(tuple(np.ravel(mean).tolist()), tuple(np.ravel(std).tolist()), x.device)
    return x.sub_(m).div_(s)


@functools.lru_cache(maxsize=64)
def _channel_stats(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean`` and ``std`` as (C, 1, 1) float32 tensors on ``device``, made once: every batch of every client
    is normalised with them, and a fresh copy to a GPU each time would wait for the GPU (see ``to_device``).
    Read only: never modified in place."""
    return (torch.tensor(mean, dtype=torch.float32, device=device).view(-1, 1, 1),
            torch.tensor(std, dtype=torch.float32, device=device).view(-1, 1, 1))


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t``, a host tensor made for this use (batch indices, noise drawn from a seeded CPU generator), on
    ``device`` without waiting for the GPU. CUDA starts a copy from pageable host memory only once the stream's
    queued kernels are done, so a copy per local step would make the host wait for the GPU at every step, and
    no kernels would be queued ahead; from pinned memory the copy is asynchronous (torch's pinned-memory cache
    keeps the block until the copy has run). Elsewhere a plain ``.to``."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
