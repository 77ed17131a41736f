"""The one round protocol: every schedule drives the runtime through the same four calls (start, results, drop,
step); a schedule registered from this file alone runs with no other change; the loop never touches the clock."""

from __future__ import annotations

import pytest

from fedray.data import build_federated_data
from fedray.runtime.local import LocalRuntime
from fedray.seeding import sample_clients
from fedray.simulation import run_experiment
from fedray.system import Report, Schedule, register_schedule
from fedray.system.rounds import fresh_round
from tests.conftest import tiny_config

PROTOCOL = ("start", "results", "drop", "step")


class Recording(LocalRuntime):
    """The in-process runtime, recording each protocol call with its arguments."""

    def __init__(self, *args, **kwargs):
        self.calls: list[tuple] = []
        super().__init__(*args, **kwargs)

    def start(self, round_, client_ids, version):
        self.calls.append(("start", round_, tuple(client_ids), version))
        return super().start(round_, client_ids, version)

    def results(self, client_ids):
        self.calls.append(("results", tuple(client_ids)))
        return super().results(client_ids)

    def drop(self, client_ids):
        self.calls.append(("drop", tuple(client_ids)))
        return super().drop(client_ids)

    def step(self, round_, client_ids, versions, weights):
        self.calls.append(("step", round_, tuple(client_ids), tuple(versions), weights))
        return super().step(round_, client_ids, versions, weights)


def _recorded(**overrides):
    cfg = tiny_config(federation__rounds=3, tracking__enabled=False, **overrides)
    runtime = Recording(cfg)
    result = run_experiment(cfg, progress=False, runtime=runtime, data=build_federated_data(cfg.data, cfg.seed))
    return runtime.calls, result


@pytest.mark.parametrize("mode", ["sync", "system", "async"])
def test_every_schedule_runs_its_rounds_through_the_same_four_calls(mode):
    """Synchronous rounds start every client from version r - 1 and step over fresh uploads with the method's own
    weights (None); FedBuff starts clients from the version current at their dispatch and steps with staleness
    weights over uploads of older versions. Nothing else of the runtime is called to run a round."""
    extra = {"system": {"system__devices": "heterogeneous", "system__overcommit": 1.5},
             "async": {"system__devices": "heterogeneous", "federation__mode": "async",
                       "federation__concurrency": 4, "federation__buffer_size": 2,
                       "federation__staleness": "polynomial"}}.get(mode, {})
    calls, result = _recorded(**extra)
    assert {c[0] for c in calls} <= set(PROTOCOL)
    steps = [c for c in calls if c[0] == "step"]
    assert [c[1] for c in steps] == [1, 2, 3] and len(result.history) == 3
    if mode == "async":
        assert all(isinstance(c[4], list) and len(c[2]) == 2 for c in steps)
        assert any(v < c[1] - 1 for c in steps for v in c[3])  # some uploads were stale
    else:
        assert all(c[4] is None and set(c[3]) == {c[1] - 1} for c in steps)
        assert [c[3] for c in calls if c[0] == "start"] == [0, 1, 2]
    if mode == "sync":
        assert [c[2] for c in calls if c[0] == "start"] == [tuple(sample_clients(0, r, 6, 3)) for r in (1, 2, 3)]


@register_schedule
class RoundRobin(Schedule):
    """A schedule of this test's own: round r trains the next clients_per_round clients in turn."""

    name = "test_round_robin"

    def __init__(self, num_clients: int, per_round: int):
        self.num_clients, self.per_round = num_clients, per_round

    @classmethod
    def build(cls, cfg, num_clients):
        return cls(num_clients, cfg.federation.clients_per_round)

    def step(self, round_, work):
        first = (round_ - 1) * self.per_round
        clients = sorted((first + i) % self.num_clients for i in range(self.per_round))
        step, down = fresh_round(work, round_, clients)
        return Report(step, float(sum(down)))


def test_a_schedule_registered_from_a_test_runs_and_dispatches_its_own_way():
    calls, result = _recorded(federation__mode="test_round_robin")
    started = [c[2] for c in calls if c[0] == "start"]
    assert started == [(0, 1, 2), (3, 4, 5), (0, 1, 2)]
    sync_calls, _ = _recorded()
    assert started != [c[2] for c in sync_calls if c[0] == "start"]
    assert result.history[-1]["eval/accuracy"] is not None and "sim/round_s" not in result.history[-1]


def test_a_schedule_name_is_taken_once_and_registering_the_same_class_again_changes_nothing():
    from fedray.system.protocol import SCHEDULES

    assert register_schedule(RoundRobin) is RoundRobin and SCHEDULES["test_round_robin"] is RoundRobin
    for name in ("test_round_robin", "sync"):  # a test's, and a built-in one named by its module
        impostor = type("Impostor", (RoundRobin,), {"name": name})
        with pytest.raises(ValueError, match=f"schedule name '{name}' is already taken"):
            register_schedule(impostor)
        assert SCHEDULES[name] is not impostor


def test_an_unknown_mode_is_refused_naming_the_modes_allowed():
    from fedray.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_config(federation__mode="semi_sync")
    assert e.value.key == "federation.mode" and "allowed: sync, async" in e.value.message


@register_schedule  # at import, once: a test run twice in one process (mutmut's) would register a second class
class Stale(RoundRobin):
    name = "test_stale"
    stale = True


def test_a_stale_schedule_is_refused_to_a_method_without_asynchronous_support():
    from fedray.errors import ConfigError
    from fedray.methods import resolve_experiment

    with pytest.raises(ConfigError) as e:
        resolve_experiment(tiny_config(federation__mode="test_stale", algorithm__name="scaffold"))
    assert e.value.key == "federation.mode" and "'scaffold' cannot run test_stale" in e.value.message
    resolve_experiment(tiny_config(federation__mode="test_stale", algorithm__name="fedprox"))


class KeepsTrack(LocalRuntime):
    """The in-process runtime, noting each client's state and channel state as its aggregated work left it."""

    def __init__(self, *args, **kwargs):
        self.kept: dict[int, tuple] = {}
        self.dropped: list[int] = []
        super().__init__(*args, **kwargs)

    def drop(self, client_ids):
        self.dropped += client_ids
        return super().drop(client_ids)

    def step(self, round_, client_ids, versions, weights):
        for cid in client_ids:
            _, state, _, wire = self._work[cid][1]
            self.kept[cid] = (state, wire)
        return super().step(round_, client_ids, versions, weights)


@pytest.mark.parametrize("mode", ["system", "async"])
def test_a_dropped_clients_work_leaves_its_state_as_its_last_aggregated_work_left_it(mode):
    """Stragglers of over-committed rounds (SCAFFOLD's control variates) and FedBuff's dropouts past the deadline
    (FedAvg: error feedback's residual, the state a client keeps under compression): a client's state is that of its
    last aggregated work, never of work that was dropped, and a client never aggregated keeps none."""
    import torch

    if mode == "system":
        extra = {"algorithm__name": "scaffold", "system__devices": "heterogeneous", "system__overcommit": 1.5,
                 "system__speed_sigma": 0.5, "federation__rounds": 4}
    else:
        extra = {"federation__mode": "async", "federation__concurrency": 4, "federation__buffer_size": 2,
                 "system__devices": "heterogeneous", "system__deadline_s": 3.0, "system__speed_sigma": 0.5, "federation__rounds": 6,
                 "channel__sparsify": "topk", "channel__fraction": 0.2, "channel__error_feedback": True}
    cfg = tiny_config(tracking__enabled=False, **extra)
    runtime = KeepsTrack(cfg)
    run_experiment(cfg, progress=False, runtime=runtime, data=build_federated_data(cfg.data, cfg.seed))
    states = runtime.channel_states if mode == "async" else runtime.client_states
    assert runtime.dropped and set(runtime.dropped) & set(runtime.kept)  # some aggregated clients dropped later too
    assert set(states) == set(runtime.kept)
    for cid, kept in runtime.kept.items():
        mine = kept[1] if mode == "async" else kept[0]
        leaves = [torch.equal(a, b) for a, b in zip(_tensors(states[cid]), _tensors(mine))]
        assert leaves and all(leaves), cid


def _tensors(state):
    from fedray.learning.weights import leaves

    return [t for t in leaves(state) if isinstance(t, __import__("torch").Tensor)]


def test_a_round_in_which_no_client_finished_stops_the_run_saying_so():
    """Every client of round 1 lost (its result None: dropped after failures or timeouts on Ray): the run stops with
    one line naming the round, before any step."""
    from fedray.errors import RunFailure

    class AllLost(Recording):
        def results(self, client_ids):
            super().results(client_ids)
            return [None] * len(client_ids)

    cfg = tiny_config(federation__rounds=3, tracking__enabled=False)
    runtime = AllLost(cfg)
    with pytest.raises(RunFailure) as e:
        run_experiment(cfg, progress=False, runtime=runtime, data=build_federated_data(cfg.data, cfg.seed))
    assert str(e.value) == "round 1: no client finished (all dropped after failures or timeouts)"
    assert [c[0] for c in runtime.calls] == ["start", "results"]
