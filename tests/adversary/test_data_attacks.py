"""The data attacks (fedray/adversary/data.py): the trigger and the flips by hand, the poisoned share, where the
poisoning happens (a copy, the same every round, alone or batched, malicious clients only), the label counts the
server is told, and ``eval/attack_success`` by hand, in a run and on Ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedray.adversary import malicious_clients
from fedray.adversary.data import Backdoor, DataAttack, data_attack, poisoned_labels, stamp
from fedray.data import build_federated_data
from fedray.errors import ConfigError
from fedray.evaluation import EvalIndex, Evaluator, personal_attack_success
from fedray.methods import validate_experiment
from fedray.runtime import make_runtime
from fedray.runtime.core import ClientWorkerCore
from fedray.runtime.server_core import ServerCore
from fedray.runtime.personal import COUNTS, personal_evaluation
from fedray.runtime.server_inputs import client_label_counts
from fedray.seeding import sample_clients
from tests.conftest import DAFKD_TINY, tiny_config

CPU = torch.device("cpu")
BACKDOOR = {"adversary__attack": "backdoor", "adversary__fraction": 0.5}


def _poisoned(**overrides):
    cfg = validate_experiment(tiny_config(federation__local_steps=1, **overrides))
    return cfg, build_federated_data(cfg.data, cfg.seed)


def test_the_trigger_by_hand():
    x = np.arange(2 * 2 * 4 * 4, dtype=np.uint8).reshape(2, 2, 4, 4)
    before = x.copy()
    out = stamp(x, 2)
    np.testing.assert_array_equal(x, before)  # a copy
    want = before.copy()
    want[:, :, 2:, 2:] = [[255, 0], [0, 255]]  # bottom-right 2x2, brightest where i + j is even, on every channel
    np.testing.assert_array_equal(out, want)
    assert stamp(np.zeros((1, 1, 3, 3), np.uint8), 3)[0, 0].tolist() == [[255, 0, 255], [0, 255, 0], [255, 0, 255]]
    assert stamp(np.full((1, 1, 2, 2), 0.5, np.float32), 1)[0, 0].tolist() == [[0.5, 0.5], [0.5, 1.0]]


def test_each_flip_by_hand():
    cfg = tiny_config(adversary__attack="label_flip", adversary__fraction=0.5, adversary__flip="reverse")
    y = np.array([0, 1, 2, 3, 3], dtype=np.int64)
    assert poisoned_labels(cfg.adversary, 0, 1, y, 4)[0].tolist() == [3, 2, 1, 0, 0]
    mapped = cfg.adversary.model_copy(update={"flip": "map", "flip_map": [1, 0, 3, 2]})
    assert poisoned_labels(mapped, 0, 1, y, 4)[0].tolist() == [1, 0, 3, 2, 2]
    rand = cfg.adversary.model_copy(update={"flip": "random"})
    y = np.repeat(np.arange(4), 900)
    flipped, rows = poisoned_labels(rand, 7, 3, y, 4)
    assert rows is None and y.tolist() == np.repeat(np.arange(4), 900).tolist()  # y itself untouched
    assert (flipped != y).all() and flipped.min() >= 0 and flipped.max() <= 3
    for c in range(4):  # uniform over the 3 other labels
        shares = np.bincount(flipped[y == c], minlength=4) / 900
        assert shares[c] == 0 and np.all(np.abs(np.delete(shares, c) - 1 / 3) < 0.06), shares
    np.testing.assert_array_equal(poisoned_labels(rand, 7, 3, y, 4)[0], flipped)  # drawn once: the same again
    assert not np.array_equal(poisoned_labels(rand, 7, 4, y, 4)[0], flipped)  # its own stream per client


def test_the_poisoned_share_by_hand():
    cfg = tiny_config(**BACKDOOR, adversary__target=2, adversary__poison_fraction=0.25)
    attack = DataAttack(cfg, 4)
    cid = min(attack.clients)
    y = np.zeros(10, dtype=np.int64)
    labels, rows = poisoned_labels(cfg.adversary, cfg.seed, cid, y, 4)
    assert len(rows) == 2 and labels.tolist() == [2 if i in rows else 0 for i in range(10)]  # round(0.25 x 10)
    tiny = cfg.adversary.model_copy(update={"poison_fraction": 0.1})
    assert len(poisoned_labels(tiny, 0, 1, np.zeros(3, np.int64), 4)[1]) == 1  # at least one
    x = np.full((10, 1, 5, 5), 100, np.uint8)
    px, py = attack.data(cid, x, y)
    assert (x == 100).all() and (y == 0).all()  # the arrays handed in are never written to
    np.testing.assert_array_equal(py, labels)
    np.testing.assert_array_equal(px[rows], stamp(x[rows], 3))
    np.testing.assert_array_equal(np.delete(px, rows, 0), np.delete(x, rows, 0))
    honest = next(c for c in range(6) if c not in attack.clients)
    assert attack.data(honest, x, y)[0] is x


def test_malicious_clients_train_on_their_poisoned_copy_every_round_alone_or_batched(monkeypatch):
    """The worker poisons a malicious client's data where it runs, the same in round 1 and 2 and through the batched
    path (runtime.vectorize); honest clients and the shared arrays are untouched."""
    import fedray.runtime.core as core

    seen: dict[tuple, tuple] = {}
    batched: list[int] = []
    context, vectorized = core.ClientWorkerCore._context, core.train_vectorized

    def spy(self, round_, client_id, state):
        ctx, state = context(self, round_, client_id, state)
        seen[(self.vectorize, round_, client_id)] = ctx.x.numpy().copy(), ctx.y.numpy().copy()
        return ctx, state

    def spy_vectorized(ctxs, plans, **kw):
        batched.append(len(ctxs))
        return vectorized(ctxs, plans, **kw)

    monkeypatch.setattr(core.ClientWorkerCore, "_context", spy)
    monkeypatch.setattr(core, "train_vectorized", spy_vectorized)
    cfg, data = _poisoned(**BACKDOOR)
    shared = data.train_x.copy(), data.train_y.copy()
    bad = sorted(malicious_clients(cfg))
    clients = [bad[0], *[c for c in range(6) if c not in bad][:2]]
    for vectorize in (False, True):
        run = validate_experiment(cfg.model_copy(update={"runtime": cfg.runtime.model_copy(
            update={"vectorize": vectorize})}))
        server, worker = ServerCore(run, data, CPU), ClientWorkerCore(run, data, CPU)
        for r in (1, 2):
            worker.train_many(r, clients, server.payload(0)[0], [None] * 3)
    assert batched == [3, 3]  # the batched path did train them together
    attack = data_attack(cfg, data.num_classes)
    for cid in clients:
        idx = data.client_train[cid]
        want = attack.data(cid, data.train_x[idx], data.train_y[idx])
        for key in ((False, 1), (False, 2), (True, 1), (True, 2)):
            got = seen[(*key, cid)]
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
        clean = (data.train_x[idx], data.train_y[idx])
        assert (cid in bad) == (not np.array_equal(want[1], clean[1]))
    np.testing.assert_array_equal(data.train_x, shared[0])
    np.testing.assert_array_equal(data.train_y, shared[1])


def test_the_label_counts_follow_the_poisoned_labels():
    """What the server is told before round 1 (``client_label_counts``) and what an upload counts (``counted_upload``
    from ctx.y) are the client's labels as it holds them."""
    cfg, data = _poisoned(adversary__attack="label_flip", adversary__clients=[1], algorithm__name="fedgen",
                          algorithm__gen_steps=1, algorithm__hidden=8, algorithm__gen_batch_size=4)
    clean = np.stack([np.bincount(data.train_y[i], minlength=10) for i in data.client_train])
    flipped = clean.copy()
    flipped[1] = clean[1][::-1]  # reverse: class c's samples now say 9 - c
    np.testing.assert_array_equal(client_label_counts(data, data_attack(cfg, 10)), flipped)
    server, worker = ServerCore(cfg, data, CPU), ClientWorkerCore(cfg, data, CPU)
    payload = server.payload(0)[0]
    for cid in (0, 1):
        upload = worker.train(1, cid, payload, None)[0]
        np.testing.assert_array_equal(upload.label_counts.numpy(), flipped[cid])
    dafkd = validate_experiment(tiny_config(**DAFKD_TINY, algorithm__name="dafkd", algorithm__alpha_source="theorem1",
                                            algorithm__distill_data="proxy", adversary__attack="label_flip",
                                            adversary__clients=[1], data__server_data__kind="holdout",
                                            data__server_data__per_class=2, data__server_data__labelled=True))
    data = build_federated_data(dafkd.data, dafkd.seed)  # the holdout moves the partition: counted again
    flipped = client_label_counts(data)
    flipped[1] = flipped[1][::-1]
    np.testing.assert_array_equal(ServerCore(dafkd, data, CPU).algo.client_label_counts.numpy(), flipped)


class TriggerReader(torch.nn.Module):
    """Says the target (class 2) when the trigger's bottom-right pixel is bright and the image's top-left pixel is
    above mid-grey; class 0 otherwise."""

    def forward(self, x):
        logits = torch.zeros(len(x), 10)
        hit = (x[:, 0, -1, -1] > 2.0) & (x[:, 0, 0, 0] > 0.0)
        logits[hit, 2] = 1.0
        logits[~hit, 0] = 1.0
        return logits


def test_attack_success_by_hand():
    cfg, data = _poisoned(**BACKDOOR, adversary__target=2)
    data.mean, data.std = (0.5,), (0.2,)  # bright 255 -> 2.5, mid-grey 127.5 -> 0
    back, model = Backdoor(2, 3), TriggerReader()
    other = data.test_y != 2
    want = float((data.test_x[other][:, 0, 0, 0] > 127.5).mean())
    assert 0.2 < want < 0.8  # neither all nor none
    ev = Evaluator(data, model, CPU, 64, backdoor=back)
    got = ev.evaluate({})
    assert got["eval/attack_success"] == pytest.approx(want, abs=1e-12)
    plain = Evaluator(data, model, CPU, 64).evaluate({})
    assert got == {**plain, "eval/attack_success": got["eval/attack_success"]}  # nothing else moved
    # spread over parts as the Ray workers score it, merged as the driver merges it
    index, ok = EvalIndex(data, back), np.zeros(ev.index.size, bool)
    for part in range(3):
        for (start, stop), hits in zip(ev.chunks()[part::3], ev.correct(model, ev.chunks()[part::3])):
            ok[start:stop] = hits
    assert index.metrics(ok) == got
    assert ev.attack_counts(model) == (round(want * other.sum()), int(other.sum()))
    # personalised: the honest clients' own models, averaged; a malicious client's row is (0, 0)
    assert personal_attack_success(np.array([[3, 10], [0, 0], [5, 10]])) == pytest.approx(0.4)
    rows = [(1, 2, 3, 4, 0, 0, 0.5, 3, 10, 0, 0), (1, 2, 3, 4, 0, 0, 0.5, 0, 0, 0, 0)]
    assert personal_evaluation(rows, backdoor=True)[0]["eval/attack_success"] == pytest.approx(0.3)
    assert "eval/attack_success" not in personal_evaluation(rows)[0]
    # the membership audit's pairs pooled over the clients: (3 + 1) / (4 + 4); none without an audit
    audited = [(*r[:-2], u, n) for r, (u, n) in zip(rows, ((3.0, 4.0), (1.0, 4.0)))]
    assert personal_evaluation(audited)[0]["diag/mia_auc"] == 0.5 and "diag/mia_auc" not in personal_evaluation(rows)[0]


def test_personalised_attack_success_scores_the_honest_clients_own_models():
    cfg, data = _poisoned(**BACKDOOR, algorithm__name="local")
    worker = ClientWorkerCore(cfg, data, CPU)
    rows = worker.evaluate_clients(list(range(6)), [None] * 6)
    bad = malicious_clients(cfg)
    triggered = int((data.test_y != cfg.adversary.target).sum())
    assert [r[COUNTS + 2] for r in rows] == [0 if c in bad else triggered for c in range(6)]  # then the audit's


@pytest.mark.parametrize("method", [pytest.param("fedavg", id="global"), pytest.param("local", id="personalised")])
def test_a_backdoor_run_reports_attack_success(method):
    """Of the global model, or (a personalised method) of the honest clients' own models."""
    from fedray.simulation import run_experiment

    result = run_experiment(tiny_config(**BACKDOOR, algorithm__name=method, federation__local_steps=2), progress=False)
    assert [0 <= h["eval/attack_success"] <= 1 for h in result.history] == [True, True]


def test_config_errors_name_the_key():
    for overrides, key in (({"adversary__trigger_size": 17}, "adversary.trigger_size"),
                           ({"adversary__target": 10}, "adversary.target"),
                           ({"adversary__flip": "random"}, "adversary.flip")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate_experiment(tiny_config(**BACKDOOR, **overrides))
    with pytest.raises(ConfigError, match=r"adversary\.flip_map"):
        validate_experiment(tiny_config(adversary__attack="label_flip", adversary__fraction=0.5,
                                        adversary__flip="map", adversary__flip_map=[0, 1]))


@pytest.mark.ray
def test_a_backdoor_run_under_fltrust_and_local_noise_on_ray_gives_the_in_process_figures(ray_local):
    """Poisoned on the workers, clipped and noised there (privacy.mechanism=local), aggregated by FLTrust in the
    server's own actor (its root data and g_0's training there), scored on two workers (the triggered test set among
    the fixed batches, the membership audit's members after them): the in-process figures exactly, each round's
    trust figures included."""
    cfg = validate_experiment(tiny_config(**BACKDOOR, federation__local_steps=2, aggregation__rule="fltrust",
                                          data__server_data__kind="holdout", data__server_data__per_class=5,
                                          privacy__mechanism="local", privacy__clip=1.0,
                                          privacy__noise_multiplier=0.01, privacy__mia_samples=50))
    ray_cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(
        update={"backend": "ray", "num_workers": 2, "server_in_driver": False})})
    data = build_federated_data(cfg.data, cfg.seed)
    figures = []
    for run in (ray_cfg, cfg):
        with make_runtime(run, data) as rt:
            assert run is cfg or rt.spread_eval
            outcomes = [rt.run_round(r, sample_clients(cfg.seed, r, 6, 3)) for r in (1, 2)]
            # what differs by runtime: the worker's pid, and Ray's own count of clients lost with a worker
            rounds = [({k: v for k, v in o.server_metrics.items() if k != "health/dropped_clients"},
                       [{k: v for k, v in i.items() if k != "pid"} for i in o.client_infos]) for o in outcomes]
            figures.append((rounds, rt.evaluate()))
    assert {"eval/attack_success", "diag/mia_auc"} <= set(figures[0][1]) and figures[0] == figures[1]
    assert all("agg/fltrust_mean_trust" in metrics for metrics, _ in figures[0][0])
