"""FLTrust as ``aggregation.rule=fltrust`` (Cao et al., NDSS 2021): the rule by hand with g_0 given, g_0 as the server
computes it (the method's own client update on the labelled server data, the training a client holding that data
runs), a sign-flipped client trusted 0 in a run, the server's extra work on the simulated clock, and the config's
refusals in one line. The arithmetic of ``fltrust`` itself: tests/learning/test_robust_aggregation.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from fedray.data import build_federated_data
from fedray.errors import ConfigError
from fedray.learning.robust import FLTrust
from fedray.learning.training import run_update
from fedray.methods import ClientContext, register_algorithm, resolve_experiment
from fedray.learning.boundary import model_field
from fedray.methods.fedavg import FedAvg, ModelUpload
from fedray.runtime.core import ClientWorkerCore
from fedray.runtime.server_core import ServerCore
from fedray.seeding import derive_seed
from fedray.simulation import run_experiment
from tests.conftest import LEARNABLE, tiny_config

ROOT = {"aggregation__rule": "fltrust", "data__server_data__kind": "holdout", "data__server_data__per_class": 5}


# --- the rule, g_0 given --------------------------------------------------------------------------------------------
def test_the_rule_takes_g0_of_the_calls_layout_and_counts_zero_trust():
    """g_0 = (1, 0 | 0) over a weights dict's floating entries w (2,) and b (1,) from r = (1, 1 | 0); updates
    (2, 0 | 0), (-3, 0 | 0), (1, 1 | 0): TS 1, 0, 1/sqrt2; rescaled to ||g_0|| = 1 and weighed, r + (1.5, 0.5 | 0) /
    (1 + 1/sqrt2) (test_robust_aggregation's numbers). Sample weights change nothing; the integer buffer is the first
    upload's."""
    def model(w, b, n):
        return {"w": torch.tensor(w), "b": torch.tensor([b]), "n": torch.tensor(n)}

    ref = model([1.0, 1.0], 0.0, 0)
    items = [model([3.0, 1.0], 0.0, 5), model([-2.0, 1.0], 0.0, 6), model([2.0, 2.0], 0.0, 7)]
    rule = FLTrust()
    with pytest.raises(RuntimeError, match="begin_step"):
        rule.mean(items, [1, 1, 1], reference=ref)
    # the root upload: its model's entries (path in the upload, update), and another model of another layout
    rule.begin_step([(("weights", "w"), torch.tensor([1.0, 0.0], dtype=torch.float64)),
                     (("weights", "b"), torch.tensor([0.0], dtype=torch.float64)),
                     (("other", "w"), torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64))])
    with pytest.raises(ValueError, match="reference="):
        rule.mean(items, [1, 1, 1])
    out = rule.mean(items, [9, 1, 1], reference=ref)
    s = 1 + 1 / math.sqrt(2)
    assert out["w"].tolist() == pytest.approx([1 + 1.5 / s, 1 + 0.5 / s]) and out["b"].tolist() == [0.0]
    assert out["w"].dtype == torch.float32 and out["n"].item() == 5
    assert rule.step_metrics() == pytest.approx({"agg/fltrust_zero_trust": 1.0,
                                                 "agg/fltrust_mean_trust": (1 + 1 / math.sqrt(2)) / 3})
    assert rule.step_metrics() == {}  # taken once a step
    with pytest.raises(RuntimeError, match="layout"):  # no model of the root upload has these keys
        rule.mean([{"v": torch.zeros(2)}], [1], reference={"v": torch.zeros(2)})


# --- g_0 as the server computes it ---------------------------------------------------------------------------------
def _step(cfg, data):
    """A server and a worker of ``cfg``; client 0's round-1 upload through the server's step. Returns (the server, the
    payload the client trained from, the step's figures)."""
    server = ServerCore(cfg, data, torch.device("cpu"))
    payload, _ = server.payload(0)
    upload = ClientWorkerCore(cfg, data, torch.device("cpu")).train(1, 0, payload, None)[0]
    return server, payload, server.step(1, [upload], [0], [0], None, [])


def test_g0_is_the_methods_client_update_on_the_root_data():
    """The update the server handed the rule is FedAvg's client_update run by hand for a client holding the labelled
    server data, seeded by (run seed, "fltrust", round), from the model the clients trained from; and (full batches,
    so that the batch order cannot matter) it is what a worker computes for a client holding that data."""
    cfg = tiny_config(**ROOT)
    data = build_federated_data(cfg.data, cfg.seed)
    server, payload, metrics = _step(cfg, data)
    assert set(metrics) >= {"agg/fltrust_zero_trust", "agg/fltrust_mean_trust"}
    root = dict(server.channel.aggregation.root)

    algo, sd = server.algo, server.algo.server_data
    ctx = ClientContext(client_id=-1, round=1, seed=derive_seed(cfg.seed, "fltrust", 1), x=sd.x, y=sd.y, spec=algo.spec,
                        fed=cfg.federation, device=torch.device("cpu"), modules=algo.build_modules(),
                        architecture=cfg.model.name)
    by_hand = run_update(ctx, algo.client_update(ctx, payload, None)).upload.weights
    floating = [k for k, v in payload.weights.items() if torch.is_floating_point(v)]
    assert list(root) == [("weights", k) for k in floating]  # the model tensors, none of the integer buffers
    for k in floating:
        assert torch.equal(root[("weights", k)], by_hand[k].double() - payload.weights[k].double()), k
    assert max(float(g.abs().max()) for g in root.values()) > 0

    # a worker whose client 0 holds the server's data, trained on full batches
    full = tiny_config(**ROOT, federation__batch_size=len(sd.y), federation__local_steps=2)
    server, payload, _ = _step(full, data)
    n = len(data.train_y)
    held = dataclasses.replace(data, train_x=np.concatenate([data.train_x, data.server.x]),
                               train_y=np.concatenate([data.train_y, data.server.y]),
                               client_train=[np.arange(n, n + len(data.server.y))] + data.client_train[1:])
    upload = ClientWorkerCore(full, held, torch.device("cpu")).train(1, 0, payload, None)[0]
    for (_, k), g in server.channel.aggregation.root:
        assert torch.allclose(g, upload.weights[k].double() - payload.weights[k].double(), rtol=1e-4, atol=1e-6), k


@register_algorithm
class RoundAndStateShown(FedAvg):
    """FedAvg whose upload's first tensor carries what its client saw: the round, the learning rate, whose state,
    whether the model bank gave it a module of its architecture (1) or not (0), its id; its broadcasts' rounds
    noted."""

    name = "test_round_and_state_shown"
    robust_means = ("weights",)
    broadcasts: list[int] = []

    def init_client_state(self, client_id):
        return {"owner": client_id}

    def broadcast(self, state, round_):
        self.broadcasts.append(round_)
        return super().broadcast(state, round_)

    def client_update(self, ctx, payload, state):
        result = run_update(ctx, super().client_update(ctx, payload, state))
        first = next(k for k, v in result.upload.weights.items() if torch.is_floating_point(v))
        shown = payload.weights[first].clone()
        own = float(ctx.own_model().state_dict().keys() == payload.weights.keys())
        shown.view(-1)[:5] += torch.tensor([ctx.round, ctx.fed.lr, state["owner"], own, ctx.client_id],
                                           dtype=shown.dtype)
        result.upload = dataclasses.replace(result.upload, weights={**result.upload.weights, first: shown})
        return result


def test_the_root_client_trains_as_a_client_of_that_round_with_its_own_state():
    """Server step 3 under a cosine schedule: the pseudo-client (id -1, its state from init_client_state(-1)) sees
    round 3 and round 3's learning rate, and a module of its architecture from the server's model bank; the server
    trains it from its broadcast for round 3. Without labelled server data the root training refuses to start."""
    from fedray.runtime.root import ROOT_CLIENT, RootTraining

    cfg = tiny_config(**ROOT, algorithm__name="test_round_and_state_shown", federation__lr_schedule="cosine",
                      federation__rounds=5)
    data = build_federated_data(cfg.data, cfg.seed)
    server = ServerCore(cfg, data, torch.device("cpu"))
    root = RootTraining(cfg, server.algo, server.algo.build_modules(), torch.device("cpu"))
    payload = server.algo.broadcast(server.state, 3)
    _, g0 = root.update(3, payload).update[0]
    assert g0.reshape(-1)[:5].tolist() == pytest.approx([3, cfg.federation.lr_at(3), ROOT_CLIENT, 1, ROOT_CLIENT],
                                                        rel=1e-6)
    assert cfg.federation.lr_at(3) != cfg.federation.lr
    RoundAndStateShown.broadcasts.clear()
    _, g0 = server._root_update(3).update[0]
    assert RoundAndStateShown.broadcasts == [3] and g0.reshape(-1)[3] == pytest.approx(1, rel=1e-6)
    server.algo.server_data = dataclasses.replace(server.algo.server_data, y=None)
    with pytest.raises(ValueError) as e:
        RootTraining(cfg, server.algo, server.algo.build_modules(), torch.device("cpu"))
    assert str(e.value) == "aggregation.rule=fltrust needs labelled data.server_data on the server"


@dataclasses.dataclass
class Counts:
    """An upload with no model field against the payload: nothing for g_0."""

    values: torch.Tensor


class UploadReplaced(FedAvg):
    """FedAvg whose upload is replaced by ``replaced(upload)``."""

    def client_update(self, ctx, payload, state):
        result = run_update(ctx, super().client_update(ctx, payload, state))
        result.upload = self.replaced(result.upload)
        return result


@dataclasses.dataclass
class WithPrivate(ModelUpload):
    """FedAvg's upload and a model the payload does not carry (sent whole, as a private discriminator is)."""

    private: dict = model_field(against=None, default_factory=dict)


@register_algorithm
class NoModelUploaded(UploadReplaced):
    name, robust_means = "test_no_model_uploaded", ("weights",)

    @staticmethod
    def replaced(upload):
        return Counts(torch.zeros(3))


@register_algorithm
class PrivateModelUploaded(UploadReplaced):
    name, robust_means = "test_private_model_uploaded", ("weights",)

    @staticmethod
    def replaced(upload):
        return WithPrivate(upload.weights, upload.num_samples, private={k: 2 * v for k, v in upload.weights.items()})


def test_g0_reads_only_the_model_fields_against_the_payload_and_none_stops_the_server_naming_the_type():
    from fedray.runtime.root import RootTraining

    def root_update(method):
        cfg = tiny_config(**ROOT, algorithm__name=method)
        server = ServerCore(cfg, build_federated_data(cfg.data, cfg.seed), torch.device("cpu"))
        root = RootTraining(cfg, server.algo, server.algo.build_modules(), torch.device("cpu"))
        return root.update(1, server.algo.broadcast(server.state, 1)).update

    assert {path[0] for path, _ in root_update("test_private_model_uploaded")} == {"weights"}
    with pytest.raises(RuntimeError) as e:
        root_update("test_no_model_uploaded")
    assert str(e.value) == ("aggregation.rule=fltrust: Counts declares no model field against the payload "
                            "(model_field(against=...)), so the server has no update to trust")


# --- in a run -------------------------------------------------------------------------------------------------------
@register_algorithm
class SignFlipClient1(FedAvg):
    """FedAvg whose client 1 uploads r - (x - r): its update sign-flipped (the pseudo-client -1 trains honestly)."""

    name = "test_sign_flip_client_1"
    robust_means = ("weights",)

    def client_update(self, ctx, payload, state):
        result = run_update(ctx, super().client_update(ctx, payload, state))
        if ctx.client_id == 1:
            flipped = {k: 2 * payload.weights[k] - w if torch.is_floating_point(w) else w
                       for k, w in result.upload.weights.items()}
            result.upload = dataclasses.replace(result.upload, weights=flipped)
        return result


def test_a_sign_flipped_client_gets_zero_trust():
    """Four clients, all in every round, on the learnable task: honest, every upload is trusted; with client 1's
    update flipped, exactly one upload a round is trusted 0 (round 1: the honest uploads are the same as before, so
    it is client 1's), and the model still learns."""
    learnable = {k.replace(".", "__"): v for k, v in LEARNABLE.items()}

    def run(name):
        cfg = tiny_config(**learnable, **ROOT, algorithm__name=name, data__num_clients=4,
                          federation__clients_per_round=4, tracking__enabled=False)
        return run_experiment(cfg, progress=False).history

    honest, attacked = run("fedavg"), run("test_sign_flip_client_1")
    assert honest[0]["agg/fltrust_zero_trust"] == 0
    assert [r["agg/fltrust_zero_trust"] for r in attacked] == [1, 1]
    assert attacked[-1]["eval/accuracy"] > 0.3  # chance: 0.1


def test_the_servers_root_training_counts_on_the_simulated_clock():
    """sim/server_samples: FedAvg's server averages (0 examples); the root training's 4 steps of 16 are one pass over
    the 50 root examples (5 a class), the last batch short: 50 examples, as a client's would count; at
    system.server_sps = 25 the server works 2 s of the round."""
    cfg = tiny_config(**ROOT, system__devices="heterogeneous", federation__rounds=1, tracking__enabled=False,
                      system__server_sps=25.0)
    first = run_experiment(cfg, progress=False).history[0]
    assert first["sim/server_samples"] == 50 and first["sim/server_s"] == 2.0


# --- the config ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,key", [
    ({"aggregation__rule": "fltrust"}, "data.server_data.kind"),  # no root data
    ({**ROOT, "data__server_data__labelled": False}, "data.server_data.labelled"),
    ({**ROOT, "algorithm__name": "scaffold"}, "aggregation.rule"),  # its means are not declared robust
])
def test_what_fltrust_needs_is_refused_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        resolve_experiment(tiny_config(**overrides))
    assert e.value.key == key and "\n" not in str(e.value)


def test_the_root_client_trains_in_the_channels_last_layout_where_the_workers_do():
    """runtime.cpu_channels_last on a CPU: the server's root-training modules and its model bank's are moved to the
    channels-last layout, as a worker's are (tests/runtime/test_channels_last.py: the same figures to rounding)."""
    from tests.runtime.test_channels_last import _layouts

    cfg = tiny_config(**ROOT, algorithm__name="test_round_and_state_shown", runtime__cpu_channels_last=True)
    server = ServerCore(cfg, build_federated_data(cfg.data, cfg.seed), torch.device("cpu"))
    server._root_update(1)
    modules = [m for m in vars(server._root.modules).values() if isinstance(m, torch.nn.Module)]
    assert modules and all(_layouts(m) == {True} for m in modules)
    assert server._root.models.channels_last is True and _layouts(server._root.models.get(cfg.model.name)) == {True}
