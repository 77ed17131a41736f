"""The server side's inputs and records, by hand: the diagnostic probe (``fedray.runtime.server_inputs``), a personalised
evaluation's tables (``fedray.runtime.personal``; over a sample of clients made on demand too), the one-time
setup bytes, and the payloads clients train from through a checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fedray.adversary.data import data_attack
from fedray.data import build_federated_data
from fedray.data.federated import to_float
from fedray.errors import RunFailure
from fedray.methods import validate_experiment
from fedray.runtime.core import ClientWorkerCore
from fedray.runtime.server_core import ServerCore
from fedray.runtime.server_inputs import client_label_counts, diagnostic_probe
from tests.conftest import DAFKD_TINY, tiny_config
from tests.runtime.test_worker_paths import _same

CPU = torch.device("cpu")
N = 4  # algorithm.diag_samples


@pytest.fixture(scope="module")
def probed():
    """DaFKD asking for N images a client, clients 0 and 1 backdoored: its config, data, algorithm and attack."""
    cfg = validate_experiment(tiny_config(**DAFKD_TINY, algorithm__name="dafkd", algorithm__diag_samples=N,
                                          adversary__attack="backdoor", adversary__clients=[0, 1]))
    data = build_federated_data(cfg.data, cfg.seed)
    return cfg, data, ServerCore(cfg, data, CPU).algo, data_attack(cfg, data.num_classes)


def _rows(images: torch.Tensor, pool: np.ndarray, spec) -> list[int]:
    """The row of ``pool`` (uint8 images) that each probe image is, normalised as the probe normalises them."""
    flat = to_float(torch.from_numpy(np.array(pool)), spec.mean, spec.std).flatten(1)
    rows = []
    for image in images.flatten(1):
        (hit,) = torch.nonzero((flat == image).all(dim=1)).flatten().tolist()  # exactly one row
        rows.append(hit)
    return rows


def test_the_probe_is_ten_n_test_images_and_n_of_each_clients_own_poisoned_as_it_holds_them(probed):
    """Client 0 (malicious) holds its rows in reverse order, as a partition need not sort them."""
    cfg, data, algo, attack = probed
    kept = data.client_train[0]
    data.client_train[0] = kept[::-1]
    try:
        probe = diagnostic_probe(data, algo, cfg.seed, CPU, attack)
        _check_probe(probe, data, algo, attack)
    finally:
        data.client_train[0] = kept


def _check_probe(probe, data, algo, attack) -> None:
    rows = _rows(probe.test_x, data.test_x, algo.spec)
    assert len(rows) == 10 * N and len(set(rows)) == 10 * N and rows == sorted(rows)  # distinct, in data order
    assert probe.test_y.tolist() == data.test_y[rows].tolist()
    assert sorted(probe.client_x) == list(range(data.num_clients))
    for cid, idx in enumerate(data.client_train):
        held = attack.data(cid, data.train_x[idx], data.train_y[idx])[0] if cid in attack.clients else data.train_x[idx]
        own = _rows(probe.client_x[cid], held, algo.spec)  # positions within the client's rows, as it holds them
        assert len(own) == N and len(set(own)) == N
        assert np.all(np.diff(idx[own]) > 0), "not in the dataset's order"
        if cid in attack.clients:  # the poisoned images, not the clean ones of the same rows
            clean = to_float(torch.from_numpy(data.train_x[idx[own]]), algo.spec.mean, algo.spec.std)
            assert not torch.equal(probe.client_x[cid], clean)
    counts = client_label_counts(data, attack)
    assert counts.dtype == np.int64 and counts.shape == (data.num_clients, data.num_classes)  # as sent: 8 bytes each
    np.testing.assert_array_equal(probe.label_counts.numpy(), counts)
    assert probe.reader is None  # diag_reader off


def test_the_probe_is_drawn_from_the_run_seed_alone(probed):
    cfg, data, algo, attack = probed
    first, again = (diagnostic_probe(data, algo, cfg.seed, CPU, attack) for _ in range(2))
    other = diagnostic_probe(data, algo, cfg.seed + 1, CPU, attack)
    assert torch.equal(first.test_x, again.test_x) and torch.equal(first.client_x[3], again.client_x[3])
    assert not torch.equal(first.test_x, other.test_x) and not torch.equal(first.client_x[3], other.client_x[3])


def test_a_small_client_gives_every_image_it_has_and_no_probe_is_made_unasked(probed):
    cfg, data, algo, attack = probed
    small = data.client_train[2][:2]
    data.client_train[2], kept = small, data.client_train[2]
    try:
        probe = diagnostic_probe(data, algo, cfg.seed, CPU, attack)
    finally:
        data.client_train[2] = kept
    assert sorted(_rows(probe.client_x[2], data.train_x[small], algo.spec)) == [0, 1]
    unasked = ServerCore(validate_experiment(tiny_config(**DAFKD_TINY, algorithm__name="dafkd",
                                                         algorithm__diag_samples=0)), data, CPU).algo
    assert diagnostic_probe(data, unasked, cfg.seed, CPU) is None


def test_clients_made_on_demand_are_refused_a_probe_and_pooled_negatives_naming_the_partition(probed):
    """What reads every client's images (the probe's diagnostics, DaFKD's pooled negatives) would make every client
    on demand: both refused in one line."""
    cfg, _, algo, _ = probed
    on_demand = tiny_config(data__partition="on_demand", data__num_clients=1000, federation__clients_per_round=5)
    data = build_federated_data(on_demand.data, on_demand.seed)
    with pytest.raises(RunFailure) as e:
        diagnostic_probe(data, algo, cfg.seed, CPU)
    assert str(e.value) == ("data.partition: dafkd's diagnostics read every client's images, which would make every "
                            "client made on demand; turn its diagnostics off or use an eager partition")
    pooled = validate_experiment(tiny_config(**DAFKD_TINY, algorithm__name="dafkd", algorithm__disc_negatives="pooled",
                                             data__partition="on_demand", data__num_clients=1000,
                                             federation__clients_per_round=5))
    with pytest.raises(RunFailure) as e:
        ClientWorkerCore(pooled, data, CPU)
    assert str(e.value) == ("data.partition: dafkd draws from every client's images (a simulation-only contrast), "
                            "which would make every client made on demand; use an eager partition")


# --- a personalised evaluation's tables (fedray.runtime.personal), by hand -------------------------------------------

# evaluate_clients rows: own correct, own n, global correct, global n, val correct, val n, own loss sum, triggered
# images read as the target, triggered images, the audit's U, its pairs
PERSONAL_ROWS = [(3, 4, 50, 100, 6, 10, 2.5, 9, 10, 6.0, 8.0),
                 (0, 0, 70, 100, 8, 10, 0.0, 0, 0, 0.0, 0.0),  # no own test split, a malicious client's (0, 0)
                 (1, 2, 20, 100, 2, 10, 1.5, 3, 10, 3.0, 4.0)]


def test_a_personalised_evaluations_figures_by_hand():
    from fedray.runtime.personal import personal_evaluation

    metrics, scores = personal_evaluation(PERSONAL_ROWS, backdoor=True, clients=[4, 7, 9])
    assert metrics == pytest.approx({
        "eval/accuracy": (0.5 + 0.7 + 0.2) / 3, "eval/amp": 4 / 6, "eval/fm": np.var([0.75, 0.5]), "eval/wlp": 0.5,
        "val/accuracy": (0.6 + 0.8 + 0.2) / 3, "eval/attack_success": (0.9 + 0.3) / 2, "diag/mia_auc": 9 / 12})
    assert scores.client.tolist() == [4, 9] and scores.loss_sum.tolist() == [2.5, 1.5]  # client 7 has no own split
    assert scores.global_correct.tolist() == [50, 20] and scores.val_samples.tolist() == [10, 10]
    plain, default = personal_evaluation([row[:-2] + (0.0, 0.0) for row in PERSONAL_ROWS])
    assert "eval/attack_success" not in plain and "diag/mia_auc" not in plain  # no backdoor, no audit pairs
    assert default.client.tolist() == [0, 2]
    one_pair, _ = personal_evaluation([(1, 1, 1, 1, 0, 0, 0.0, 0, 0, 1.0, 1.0)])
    assert one_pair["diag/mia_auc"] == 1.0  # a single pair is an audit


def test_a_personalised_evaluations_client_table_by_hand():
    from fedray.runtime.personal import client_table

    cfg = tiny_config(model__client_models=["lenet5", "cnn"])
    rows = client_table(cfg, [PERSONAL_ROWS[0][:6], (0, 0, 70, 100, 0, 0), (1, 2, 20, 100, 0, 10)], clients=[4, 7, 9])
    assert rows == [
        {"client": 4, "architecture": "lenet5", "own_correct": 3, "own_samples": 4, "own_accuracy": 0.75,
         "global_accuracy": 0.5, "val_accuracy": 0.6},
        {"client": 7, "architecture": "cnn", "own_correct": 0, "own_samples": 0, "own_accuracy": 0.0,
         "global_accuracy": 0.7},  # no validation set: no val_accuracy
        {"client": 9, "architecture": "cnn", "own_correct": 1, "own_samples": 2, "own_accuracy": 0.5,
         "global_accuracy": 0.2, "val_accuracy": 0.0}]
    (single,) = client_table(cfg, [(1, 1, 1, 1, 1, 1)])  # one sample each: divided by 1
    assert (single["own_accuracy"], single["global_accuracy"], single["val_accuracy"]) == (1.0, 1.0, 1.0)
    assert [r["client"] for r in client_table(cfg, [PERSONAL_ROWS[0][:6]] * 2)] == [0, 1]


# --- the payloads clients train from, through a checkpoint (ServerCore.export_state / import_state) ------------------

def _payloads_resumed(cfg, legacy: bool = False):
    """Versions 0-2 sent (each through the channel's downlink, its error feedback carried from one to the next), the
    state exported and imported into a fresh server: (the wires first sent, the wires the resumed server sends)."""
    data = build_federated_data(cfg.data, cfg.seed)
    first = ServerCore(cfg, data, CPU)
    sent = [first.payload(v)[0] for v in range(3)]
    state, kept, wire = first.export_state()
    if legacy:  # a checkpoint of a fedray before the channel: {version: (payload, bytes)}
        kept = {v: (k["payload"], 123) for v, k in kept.items()}
    again = ServerCore(cfg, data, CPU)
    again.import_state(state, kept, wire)
    return sent, [again.sent[v].wire for v in range(3)]


def test_a_resumed_server_sends_each_kept_version_the_very_packets_it_sent():
    """Downlink top-k with error feedback: each version's packet depends on the residual the versions before it left,
    which the checkpoint keeps per version; sent again from an empty residual, versions 1 and 2 would differ."""
    cfg = validate_experiment(tiny_config(channel__sparsify="topk", channel__fraction=0.1,
                                          channel__error_feedback=True, channel__compress_on="down"))
    sent, resent = _payloads_resumed(cfg)
    assert all(_same(a, b) for a, b in zip(sent, resent))
    assert not _same(sent[1], sent[0])  # the residual moved version 1's packet (so the check above can fail)


def test_a_checkpoint_from_before_the_channel_resumes_its_payloads():
    sent, resent = _payloads_resumed(validate_experiment(tiny_config()), legacy=True)
    assert all(_same(a, b) for a, b in zip(sent, resent))


def test_setup_bytes_add_the_server_images_clients_hold_and_the_label_counts_they_send():
    """A method doing both (none of the built-in ones does): each registered client gets the server's images and
    sends its label counts (int64), and comm/bytes_setup counts the two together."""
    import dataclasses

    from fedray.methods.fedcd import FedCD
    from fedray.methods.registry import resolve_experiment
    from fedray.runtime.server_inputs import setup_bytes
    from tests.methods.test_fedcd import FEDCD

    class FedCDCountingLabels(FedCD):
        @classmethod
        def sends_label_counts(cls, params) -> bool:
            return True

    exp = resolve_experiment(validate_experiment(tiny_config(**FEDCD)))
    data = build_federated_data(exp.cfg.data, exp.cfg.seed)
    images = int(data.server.x.nbytes) * data.num_clients
    assert setup_bytes(exp, data) == images
    assert setup_bytes(dataclasses.replace(exp, method=FedCDCountingLabels), data) == images + 8 * 10 * 6


def test_a_personalised_method_keeps_states_of_the_clients_that_trained_and_scores_the_sample(tmp_path):
    """FedCD over 300 clients made on demand, 4 a round for 2 rounds: personal models only for the (at most 8)
    clients that trained, its per-client figures over the 12 of the sample (a client of the sample that never trained
    scored with its initial model), the clients made being the sampled plus the evaluated; clients.json and
    clients.parquet name the sample's clients."""
    from fedray.simulation import run_experiment
    from tests.conftest import method_config

    cfg = method_config("fedcd", data__partition="on_demand", data__num_clients=300, federation__clients_per_round=4,
                        federation__rounds=2, data__eval_clients=12, federation__eval_every=2)
    data = build_federated_data(cfg.data, cfg.seed)
    result = run_experiment(cfg, tmp_path / "run", progress=False, data=data)
    assert data.source.derivations == 2 * 4 + 12 and "eval/amp" in result.history[-1]
    table = json.loads((tmp_path / "run" / "clients.json").read_text())
    assert [row["client"] for row in table] == data.eval_sample.tolist()
    assert pq.read_table(tmp_path / "run" / "clients.parquet")["client"].to_pylist() == data.eval_sample.tolist()
    assert 0 < len(torch.load(tmp_path / "run" / "model.pt", weights_only=False)) <= 8
