"""What a run hands a method beyond its clients' own data, and what that costs: the server's data as the method may
see it, the simulation-only diagnostic probe (and the fixed reader), every client's label counts, and the one-time
communication before round 1."""

from __future__ import annotations

import numpy as np
import torch

from fedray.adversary.data import DataAttack, data_attack
from fedray.data.federated import FederatedData, to_float
from fedray.methods import Algorithm, Experiment
from fedray.methods.api import DiagnosticProbe, ServerSideData
from fedray.seeding import derive_seed


def server_side_data(data: FederatedData, device: torch.device) -> ServerSideData | None:
    """The server's data as the method may see it: labels only when ``data.server_data.labelled``."""
    server = data.server
    if server is None:
        return None
    y = server.visible_y()
    y = torch.from_numpy(np.array(y)).to(device) if y is not None else None
    return ServerSideData(x=torch.from_numpy(np.array(server.x)).to(device), y=y, domain=server.domain)


def diagnostic_probe(data: FederatedData, algo: Algorithm, seed: int, device: torch.device,
                     attack: DataAttack | None = None) -> DiagnosticProbe | None:
    """The real data of :class:`DiagnosticProbe` for a method that asks for some (``probe_size``): 10n test
    images and n training images of each client, drawn from (run seed) alone; and the fixed reader for a method
    that scores generated samples (``wants_reader``). The clients' images and label counts are their data as they
    hold it: a malicious client's poisoned data under a data ``attack``."""
    n = algo.probe_size()
    if n <= 0 and not algo.wants_reader():
        return None
    if data.on_demand:
        from fedray.errors import RunFailure

        raise RunFailure(f"data.partition: {algo.name}'s diagnostics read every client's images, which would make "
                         "every client made on demand; turn its diagnostics off or use an eager partition")
    rng = np.random.default_rng(derive_seed(seed, "diagnostic-probe"))
    spec = algo.spec

    def images(x: np.ndarray) -> torch.Tensor:
        return to_float(torch.from_numpy(np.array(x)).to(device), spec.mean, spec.std)

    test = np.sort(rng.choice(len(data.test_y), size=min(10 * n, len(data.test_y)), replace=False))

    def own(cid: int, idx: np.ndarray) -> torch.Tensor:
        rows = np.sort(rng.choice(idx, size=min(n, len(idx)), replace=False))
        if attack is None or cid not in attack.clients:
            return images(data.train_x[rows])
        x = attack.data(cid, data.train_x[idx], data.train_y[idx])[0]
        order = np.argsort(idx)
        return images(x[order[np.searchsorted(idx, rows, sorter=order)]])  # the same rows, poisoned

    clients = {cid: own(cid, idx) for cid, idx in enumerate(data.client_train)}
    reader = None
    if algo.wants_reader():
        from fedray.reader import load_reader  # only a run that scores generated samples loads (or trains) it

        reader = load_reader(data, device)
    counts = torch.from_numpy(client_label_counts(data, attack)).float().to(device)
    return DiagnosticProbe(test_x=images(data.test_x[test]), test_y=torch.from_numpy(data.test_y[test]).long().to(device),
                           client_x=clients, label_counts=counts, reader=reader)


def client_label_counts(data: FederatedData, attack: DataAttack | None = None) -> np.ndarray:
    """Every client's training images per class, (num_clients, num_classes) int64, of its labels as it holds
    them: a malicious client's poisoned ones under a data ``attack`` (what it would count and send)."""
    def labels(cid: int, idx: np.ndarray) -> np.ndarray:
        return data.train_y[idx] if attack is None else attack.labels(cid, data.train_y[idx])

    return np.stack([np.bincount(labels(cid, idx), minlength=data.num_classes)
                     for cid, idx in enumerate(data.client_train)]).astype(np.int64)


def setup_bytes(exp: Experiment, data: FederatedData) -> int:
    """One-time communication before round 1: the server data's images sent to every registered client, for
    methods whose clients hold them (``Algorithm.clients_hold_server_images``), and every client's label counts
    (int64) sent to the server, for methods that ask for them (``Algorithm.sends_label_counts``)."""
    total = 0
    if exp.method.clients_hold_server_images and data.server is not None:
        total += int(data.server.x.nbytes) * data.num_clients
    if exp.method.sends_label_counts(exp.params):
        total += 8 * data.num_classes * data.num_clients
    return total
