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

Clients made on demand (``data.partition=on_demand``, ``data.pseudo_base_clients``; :mod:`fedray.data.on_demand`):
``source`` derives a client's data from (seed, id) when it is asked for (:meth:`FederatedData.client_data`), and
``client_train`` / ``client_test`` stay empty; what is kept per registered client is its two sizes. The per-client
figures are over ``eval_sample``, a seeded sample of ``data.eval_clients`` clients fixed for the run.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

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
from fedray.data.on_demand import PseudoClients, SampledClients
from fedray.errors import DataError

# Fixed purpose ids for the seed streams, so adding a random draw elsewhere never shifts the partition.
PARTITION_STREAM = 1
SPLIT_STREAM = 2
SERVER_STREAM = 3
VALIDATION_STREAM = 4
EVAL_SAMPLE_STREAM = 5


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
    #: clients made on demand (fedray.data.on_demand's SampledClients or PseudoClients); None: the eager lists
    source: Any = None
    #: with a ``source``: the clients whose local test splits the per-client figures are over (sorted ids)
    eval_sample: np.ndarray | None = None

    @property
    def on_demand(self) -> bool:
        return self.source is not None

    def client_data(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``k``'s training images (uint8 NCHW) and labels: its rows of ``train_x``, or made by ``source``
        (one derivation)."""
        if self.source is not None:
            made = self.source.client(k)
            return made.train_x, made.train_y
        idx = self.client_train[k]
        return self.train_x[idx], self.train_y[idx]

    def client_test_data(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``k``'s local test images and labels (made by ``source``: one derivation)."""
        if self.source is not None:
            made = self.source.client(k)
            return made.test_x, made.test_y
        idx = self.client_test[k]
        return self.train_x[idx], self.train_y[idx]

    def evaluated_clients(self) -> np.ndarray:
        """The clients whose local test splits the per-client figures are over: every client, or ``eval_sample``."""
        return self.eval_sample if self.source is not None else np.arange(self.num_clients)

    @property
    def num_val(self) -> int:
        """Samples of the validation set (0 without one)."""
        return 0 if self.val_y is None else len(self.val_y)

    @property
    def num_clients(self) -> int:
        return self.source.num_clients if self.source is not None else len(self.client_train)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)

    def client_sizes(self) -> np.ndarray:
        """Training sample count of each client (the |D_k| weights of FedAvg-style averaging)."""
        if self.source is not None:
            return self.source.train_sizes().astype(np.int64)
        return np.array([len(idx) for idx in self.client_train], dtype=np.int64)

    def client_test_sizes(self) -> np.ndarray:
        """Local test sample count of each client."""
        if self.source is not None:
            return self.source.test_sizes().astype(np.int64)
        return np.array([len(idx) for idx in self.client_test], dtype=np.int64)

    def label_counts(self) -> np.ndarray:
        """(num_clients, num_classes) label counts over each client's train and test samples (eager clients only:
        made on demand, that would make every client)."""
        if self.source is not None:
            raise ValueError("label counts of every client: their clients are made on demand")
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
        gives another. It names the run's data in MLflow (:func:`fedray.record.tracking.dataset_entity`).
        Clients made on demand: a digest of what defines them (the source's kind and parameters, every client's
        sizes, the training split's labels and pseudo-clients' base clients), each client's data being a function of
        those and its id."""
        digest = hashlib.sha256()
        if self.source is not None:
            s = self.source
            params = {k: v for k, v in vars(s).items() if isinstance(v, (int, float, str)) and k != "derivations"}
            digest.update(f"{type(s).__name__}{sorted(params.items())}".encode())
            digest.update(self.client_sizes().tobytes())
            digest.update(self.client_test_sizes().tobytes())
            digest.update(np.ascontiguousarray(self.train_y).tobytes())
            for part in (*getattr(s, "base_train", ()), *getattr(s, "base_test", ())):  # pseudo-clients' bases
                digest.update(np.int64(len(part)).tobytes())
                digest.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
            return digest.hexdigest()[:16]
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
    source = None
    if cfg.partition == "on_demand":
        source = SampledClients(train_x, train_y, raw.num_classes, cfg.num_clients, seed, cfg.alpha, cfg.test_fraction,
                                cfg.client_size, cfg.client_size_sigma)
        parts = []
    else:  # pseudo-clients: the partition's clients are their base clients
        base = cfg if cfg.pseudo_base_clients is None else cfg.model_copy(update={"num_clients":
                                                                                  cfg.pseudo_base_clients})
        parts = partition(base, train_y, seed, train_domain, domain_ids, client_names)
    rng = np.random.default_rng([seed, SPLIT_STREAM])
    splits = [split_train_test(idx, cfg.test_fraction, rng) for idx in parts]
    eval_sample = None
    if cfg.pseudo_base_clients is not None:
        source = PseudoClients(train_x, train_y, [tr for tr, _ in splits], [te for _, te in splits], cfg.num_clients,
                               seed)
        splits = []
    if source is not None:
        eval_sample = np.sort(np.random.default_rng([seed, EVAL_SAMPLE_STREAM]).choice(
            cfg.num_clients, size=min(cfg.eval_clients, cfg.num_clients), replace=False)).astype(np.int64)
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
        client_domain=None if source is not None else _client_domains(parts, train_domain),
        val_x=val_x,
        val_y=val_y,
        source=source,
        eval_sample=eval_sample,
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
