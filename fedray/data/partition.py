"""Label partitioners: split a dataset's training labels over clients (pure numpy).

Every partitioner takes an explicit ``np.random.Generator`` so the caller decides the seed stream
(``build_federated_data`` uses ``default_rng([seed, 1])``), and returns one sorted ``int64`` index array
per client. Dirichlet and IID use every sample exactly once; shards use every sample at most once.

- :func:`partition_dirichlet` is the common Dirichlet label partition, as in DaFKD's and FedKF's code
  (FedKF Sec. VI-A, Fig. 4).
- :func:`partition_shards` is FedAvg's pathological non-IID split (sort by label, deal out shards).
- :func:`partition_by_domain` (cross-silo: one client per domain) and
  :func:`partition_domain_dirichlet` (cross-device: each domain split over several clients by the
  Dirichlet label partition) are FedD3A's two settings (Sec. 4, "Cross-silo" / "Cross-device Setting").
- :func:`select_holdout` takes a fixed number of samples per class out for the server (FedCD Sec. V-A:
  a 50-per-class validation set sampled from the training set).
- :func:`split_train_test` is FedKF's per-client 80/20 train/test split.
"""

from __future__ import annotations

import numpy as np

from fedray.errors import DataError

_INT = np.int64


def _check_labels(labels: np.ndarray, num_clients: int, key: str = "data.num_clients") -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if num_clients < 1:
        raise DataError(key, f"must be >= 1, got {num_clients}")
    if num_clients > len(labels):
        raise DataError(
            key,
            f"{num_clients} clients but the training split has only {len(labels)} samples; "
            f"use at most {len(labels)} clients",
        )
    return labels


def _group(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Turn a per-sample owner id (-1 = unused) into sorted index arrays, one per client.

    A stable argsort keeps each client's indices ascending, so no per-client sort is needed.
    """
    order = np.argsort(owner, kind="stable").astype(_INT)
    counts = np.bincount(owner[owner >= 0], minlength=num_clients)
    start = int(np.count_nonzero(owner < 0))
    return np.split(order[start:], np.cumsum(counts)[:-1])


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    min_samples: int,
    rng: np.random.Generator,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Dirichlet label partition (DaFKD / FedKF code; FedD3A Sec. 4 "Cross-device Setting").

    For each class c: p ~ Dir(alpha * 1_K); clients already holding >= N/K samples get p_k = 0 and p
    is renormalised; the shuffled indices of c are cut at cumsum(p) * n_c. The whole draw is repeated
    until the smallest client holds >= ``min_samples`` samples. Vectorised per class (no loop over
    clients), so 10,000 clients cost milliseconds per try.
    """
    labels = _check_labels(labels, num_clients)
    if alpha <= 0:
        raise DataError("data.alpha", f"must be > 0, got {alpha}")
    n = len(labels)
    cap = n / num_clients
    # Indices of each class, in ascending order; shuffled afresh on every try.
    order = np.argsort(labels, kind="stable")
    classes, starts = np.unique(labels[order], return_index=True)
    class_idx = np.split(order, starts[1:])
    conc = np.full(num_clients, float(alpha))
    clients = np.arange(num_clients)
    owner = np.empty(n, dtype=_INT)
    smallest = 0
    for _ in range(max_tries):
        sizes = np.zeros(num_clients, dtype=_INT)
        ok = True
        for idx_c in class_idx:
            idx_c = rng.permutation(idx_c)
            p = rng.dirichlet(conc)
            p = np.where(sizes < cap, p, 0.0)  # full clients take no more of any class
            total = p.sum()
            if not np.isfinite(total) or total <= 0:
                # Only possible when tiny alpha underflows every open client's share to 0: redraw.
                ok = False
                break
            cuts = (np.cumsum(p / total) * len(idx_c)).astype(_INT)[:-1]
            counts = np.diff(np.concatenate(([0], cuts, [len(idx_c)])))
            owner[idx_c] = np.repeat(clients, counts)
            sizes += counts
        if not ok:
            continue
        smallest = int(sizes.min())
        if smallest >= min_samples:
            return _group(owner, num_clients)
    raise DataError(
        "data.min_samples",
        f"after {max_tries} draws could not give every one of {num_clients} clients >= {min_samples} "
        f"samples at alpha={alpha} ({n} samples; the last draw's smallest client had {smallest}); "
        "lower data.min_samples, raise data.alpha or use fewer data.num_clients",
    )


def partition_iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Equal-size uniform random split (sizes differ by at most one); every sample used once."""
    labels = _check_labels(labels, num_clients)
    perm = rng.permutation(len(labels)).astype(_INT)
    return [np.sort(part) for part in np.array_split(perm, num_clients)]


def partition_shards(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """FedAvg's shard split: sort by label, cut into K*s shards, give each client s shards at random.

    Each shard spans at most two labels when every class is at least a shard long, so a client holds
    at most 2*s labels. Ties within a label are shuffled first, so shard contents vary with the seed.
    """
    labels = np.asarray(labels)
    if shards_per_client < 1:
        raise DataError("data.shards_per_client", f"must be >= 1, got {shards_per_client}")
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise DataError(
            "data.shards_per_client",
            f"{num_clients} clients x {shards_per_client} shards = {num_shards} shards but only "
            f"{len(labels)} training samples; lower data.shards_per_client or data.num_clients",
        )
    labels = _check_labels(labels, num_clients)
    perm = rng.permutation(len(labels))
    by_label = perm[np.argsort(labels[perm], kind="stable")].astype(_INT)
    shards = np.array_split(by_label, num_shards)  # sizes differ by at most one; all samples used
    deal = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in row])) for row in deal]


def partition_by_domain(domain: np.ndarray, domain_ids) -> list[np.ndarray]:
    """Cross-silo (FedD3A Sec. 4): client k holds every sample whose ``domain`` is ``domain_ids[k]``."""
    domain = np.asarray(domain)
    return [np.flatnonzero(domain == d).astype(_INT) for d in domain_ids]


def partition_domain_dirichlet(
    labels: np.ndarray,
    domain: np.ndarray,
    domain_ids,
    clients_per_domain: int,
    alpha: float,
    min_samples: int,
    rng: np.random.Generator,
    names=None,
) -> list[np.ndarray]:
    """Cross-device (FedD3A Sec. 4): each domain's samples split over ``clients_per_domain`` clients.

    Every domain gets its own :func:`partition_dirichlet` (Dir(alpha) per class, within the domain),
    drawn from ``rng`` in ``domain_ids`` order; clients are numbered domain-major (domain ``i``'s
    clients are ``i * clients_per_domain ...``). ``names`` (one per id) only improves error messages.
    """
    labels, domain = np.asarray(labels), np.asarray(domain)
    parts: list[np.ndarray] = []
    for i, d in enumerate(domain_ids):
        idx = np.flatnonzero(domain == d).astype(_INT)
        name = repr(names[i]) if names is not None else str(d)
        try:
            sub = partition_dirichlet(labels[idx], clients_per_domain, alpha, min_samples, rng)
        except DataError as e:
            key = "data.clients_per_domain" if e.key == "data.num_clients" else e.key
            raise DataError(key, f"domain {name}: {e.message}".replace(
                "use fewer data.num_clients", "use fewer data.clients_per_domain").replace(
                "clients but", "clients per domain but")) from None
        parts.extend(idx[s] for s in sub)
    return parts


def select_holdout(
    labels: np.ndarray, per_class: int, num_classes: int, rng: np.random.Generator,
    key: str = "data.server_data.per_class", purpose: str = "for the server",
) -> np.ndarray:
    """``per_class`` random samples of each of the ``num_classes`` classes (FedCD Sec. V-A; the validation
    set of ``data.val_per_class``, ``key`` and ``purpose`` naming it in the error).

    Returns their sorted int64 indices. Every class must keep at least one sample for the clients.
    """
    labels = np.asarray(labels)
    counts = np.bincount(labels, minlength=num_classes)
    short = np.flatnonzero(counts <= per_class)
    if short.size:
        c = int(short[0])
        raise DataError(
            key,
            f"{per_class} per class cannot be held out {purpose}: class {c} has only "
            f"{int(counts[c])} training sample(s) ({short.size} class(es) have <= {per_class}); use at "
            f"most {max(int(counts.min()) - 1, 0)}",
        )
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    held = order[(starts[:, None] + np.arange(per_class)[None, :]).ravel()]
    return np.sort(held).astype(_INT)


def split_train_test(
    indices: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """FedKF's per-client split: shuffle, ``round(test_fraction * n)`` to test (at least 1, and at
    least 1 left to train). Returns sorted ``(train, test)`` int64 index arrays."""
    indices = np.asarray(indices, dtype=_INT)
    n = len(indices)
    if n < 2:
        raise DataError(
            "data.num_clients",
            f"a client holds {n} sample(s) but its train/test split needs >= 2; use fewer "
            "data.num_clients (or raise data.min_samples for the Dirichlet partition)",
        )
    if not 0 < test_fraction < 1:
        raise DataError("data.test_fraction", f"must be in (0, 1), got {test_fraction}")
    n_test = min(max(int(round(test_fraction * n)), 1), n - 1)
    perm = rng.permutation(indices)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])
