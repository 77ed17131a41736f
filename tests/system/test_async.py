"""Buffered asynchronous aggregation (FedBuff) on the simulated clock: the schedule by hand, the staleness-weighted
server step by hand, the methods that refuse it, and Ray returning results in another order than the simulated
one."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fedray.errors import ConfigError
from fedray.methods import ServerContext, resolve_experiment
from fedray.methods.fedavg import ModelPayload, ModelState, ModelUpload
from fedray.simulation import run_experiment
from fedray.system import SystemClock, SystemConfig
from fedray.system.fedbuff import FedBuff, staleness_weight
from tests.conftest import tiny_config


def _schedule(tmp_path, speeds, concurrency, buffer, online=None, staleness="none", deadline=None, **system):
    devices = tmp_path / "devices.csv"
    devices.write_text("client,compute_sps,up_mbps,down_mbps,latency_ms\n"
                       + "".join(f"{c},{s},1000,1000,0\n" for c, s in enumerate(speeds)))
    extra = {}
    if online is not None:
        path = tmp_path / "online.csv"
        path.write_text("client,start_s,end_s\n" + "".join(f"{c},{a},{b}\n" for c, a, b in online))
        extra = {"availability": "trace", "availability_trace": str(path)}
    cfg = SystemConfig(devices="trace", trace=str(devices), deadline_s=deadline, **extra, **system)
    return FedBuff(SystemClock(cfg, len(speeds), 1, seed=0), concurrency, buffer, staleness)


class _Figures:
    """The work's side of the protocol, as a schedule's timing reads it: every client's work ``samples`` long."""

    def __init__(self, samples):
        self.samples = samples

    def results(self, client_ids):
        return [{"work_samples": self.samples, "bytes_up": 0} for _ in client_ids]


def _time_all(s, samples=10):
    s.time(_Figures(samples))


def _live(s):
    return sorted({f.version for f in s.flight.values()})


def test_events_follow_the_simulated_clock_and_a_finished_client_is_replaced(tmp_path):
    """Three at once among four clients: the fastest arrives first; its place goes to the one left; the server
    steps after two arrivals; every arrival waits in the buffer until its step."""
    s = _schedule(tmp_path, speeds=[10, 5, 2, 1], concurrency=3, buffer=2)
    started, waited = s.dispatch()
    assert waited == 0.0
    assert len(started) == 3 and all(s.flight[c].version == 0 for c in started)
    idle = ({0, 1, 2, 3} - set(started)).pop()
    _time_all(s)
    first = min(started, key=lambda c: 10 / [10, 5, 2, 1][c])
    assert s.next_event()[:2] == (first, True) and s.clock.clock == pytest.approx(10 / [10, 5, 2, 1][first])
    assert s.dispatch()[0] == [idle] and s.flight[idle].version == 0  # never one in flight or in the buffer
    assert s.dispatch()[0] == []
    _time_all(s)
    second, arrived, _ = s.next_event()
    assert arrived and len(s.buffer) == 2
    clients, versions, weights, taus = s.take_buffer()
    assert clients == sorted([first, second]) and versions == [0, 0] and weights == [1.0, 1.0] and taus == [0, 0]
    assert s.version == 1 and _live(s) == [0] and not s.buffer


class _Work:
    """The runtime's side of the protocol for a schedule alone: every client's work 10 samples, nothing sent; each
    server step's clients noted, its work ``server_samples`` long."""

    def __init__(self, server_samples=0.0):
        self.server_samples, self.steps, self.dropped = server_samples, [], []

    def start(self, round_, client_ids, version):
        return [0] * len(client_ids)

    def results(self, client_ids):
        return [{"work_samples": 10, "bytes_up": 0} for _ in client_ids]

    def drop(self, client_ids):
        self.dropped += client_ids

    def step(self, round_, client_ids, versions, weights):
        from fedray.system import Step

        self.steps.append(list(client_ids))
        return Step([{} for _ in client_ids], {"sim/server_samples": self.server_samples})


def test_a_fedbuff_round_by_hand_takes_exactly_buffer_size_uploads_then_the_servers_time(tmp_path):
    """Speeds 10, 5, 2, 1 samples/s, all four at once, a buffer of 2, the server at 500 samples/s over 1,000: every
    client starts at 0 s; 0 arrives at 1 s, 1 at 2 s and the buffer is full: the step takes exactly those two (2 and 3
    still training), then the server works 1000 / 500 = 2 s, so the round ends at 4 s. The next step again takes two
    uploads and pays the server's 2 s."""
    s = _schedule(tmp_path, speeds=[10, 5, 2, 1], concurrency=4, buffer=2, server_sps=500.0)
    work = _Work(server_samples=1000.0)
    report = s.step(1, work)
    assert work.steps == [[0, 1]] and not work.dropped
    assert report.sim["sim/server_s"] == 2.0 and report.sim["sim/round_s"] == 4.0 and s.clock.clock == 4.0
    assert report.sim["sim/selected"] == 4.0 and sorted(s.flight) == [2, 3]
    before = s.clock.clock
    report = s.step(2, work)
    assert len(work.steps[1]) == 2 and report.sim["sim/server_s"] == 2.0
    assert s.clock.clock - before == pytest.approx(report.sim["sim/round_s"])


def test_staleness_is_the_server_steps_since_the_dispatch():
    assert staleness_weight("none", 5) == 1.0
    assert staleness_weight("polynomial", 0) == 1.0 and staleness_weight("polynomial", 3) == 0.5


@pytest.mark.parametrize("staleness, weight", [("polynomial", 1 / math.sqrt(1 + 3)), ("none", 1.0)])
def test_a_stale_upload_is_weighted_by_its_age(tmp_path, staleness, weight):
    """Client 1 (slow) is dispatched at version 0 and arrives after the server stepped three times on client 0:
    (1 + 3)^-1/2 with polynomial weights, 1 without."""
    s = _schedule(tmp_path, speeds=[10, 1], concurrency=2, buffer=1, staleness=staleness)
    s.dispatch()
    _time_all(s)  # client 0 takes 1 s, client 1 10 s
    for version in (0, 1):
        assert s.next_event()[:2] == (0, True)
        assert s.take_buffer() == ([0], [version], [1.0], [0])
        assert s.dispatch()[0] == [0] and s.flight[0].version == version + 1
        _time_all(s)
    assert _live(s) == [0, 2]
    s.next_event()  # client 0 again, at 3 s
    s.take_buffer()
    assert s.next_event() == (1, True, 10.0) and s.clock.clock == 10.0
    assert s.take_buffer() == ([1], [0], [weight], [3])


def test_a_client_that_goes_offline_or_passes_the_deadline_is_a_dropout(tmp_path):
    s = _schedule(tmp_path, speeds=[10, 10, 1], concurrency=3, buffer=1, deadline=5.0,
                  online=[(0, 0, 100), (1, 0, 0.5), (2, 0, 100)])
    s.dispatch()
    _time_all(s)  # 1 s, 1 s (but offline at 0.5 s), 10 s (past the 5 s deadline)
    assert s.next_event()[:2] == (1, False) and s.clock.clock == 0.5  # known gone when it goes
    assert s.next_event()[:2] == (0, True)
    assert s.next_event() == (2, False, 10.0) and s.clock.clock == 5.0  # known late at the deadline
    assert s.clock.busy_s.tolist() == [1.0, 0.5, 5.0]
    # events.parquet's rows of the step: (client, start, settled at, outcome)
    assert [(c, start, at, fate) for c, start, at, _, fate in s.settled] == [
        (1, 0.0, 0.5, "dropout_offline"), (0, 0.0, 1.0, "aggregated"), (2, 0.0, 5.0, "dropout_deadline")]
    both = _schedule(tmp_path, speeds=[2], concurrency=1, buffer=1, deadline=5.0, online=[(0, 0, 4.0)])
    both.dispatch()
    _time_all(both)  # 5 s of work, exactly the deadline, but offline at 4 s: gone before it could be late
    assert both.next_event() == (0, False, 5.0) and both.settled[0][-1] == "dropout_offline"


def test_an_async_client_trains_at_the_speeds_of_the_step_it_trains_for(tmp_path):
    """With speeds that vary by round, a client dispatched at version v works at round v + 1's speeds (those of the
    server step its upload is for, as a synchronous round r's clients work at round r's)."""
    s = _schedule(tmp_path, speeds=[10, 5], concurrency=2, buffer=2, speed_sigma=0.5)
    s.dispatch()
    _time_all(s, samples=10)
    for c, sps in enumerate([10, 5]):
        compute = {r: float(s.clock.devices.factors(np.array([c]), r)[0][0]) for r in (0, 1, 2)}
        assert len(set(compute.values())) == 3  # the rounds' draws differ
        assert s.flight[c].parts["compute_s"] == pytest.approx(10 / (sps * compute[1]), rel=1e-12)


def test_at_the_deadline_or_going_offline_as_it_finishes_an_upload_arrives(tmp_path):
    """The boundaries, as the synchronous clock has them: a client whose work ends exactly at the deadline (10
    samples at 2/s: 5 s, deadline 5 s) arrives, and so does one that goes offline exactly as it finishes (1 s of work,
    online until 1 s); a hair later each is a dropout."""
    s = _schedule(tmp_path, speeds=[10, 2], concurrency=2, buffer=2, deadline=5.0, online=[(0, 0, 1.0), (1, 0, 100)])
    s.dispatch()
    _time_all(s)
    assert s.next_event() == (0, True, 1.0) and s.next_event() == (1, True, 5.0)
    late = _schedule(tmp_path, speeds=[10, 2], concurrency=2, buffer=2, deadline=4.999,
                     online=[(0, 0, 0.999), (1, 0, 100)])
    late.dispatch()
    _time_all(late)
    assert late.next_event()[:2] == (0, False) and late.next_event()[:2] == (1, False)


def test_the_fedbuff_step_by_hand():
    """Two uploads from the model sent at version 0, one fresh and one two steps stale, polynomial weights:
    w_now + sum_k p_k s_k (w_k - w_sent) / sum_k p_k; fresh uploads of weight 1 give FedAvg's average exactly."""
    cfg = tiny_config()
    algo = resolve_experiment(cfg).build(type("S", (), {"input_shape": (1, 4, 4), "num_classes": 2})())
    sent = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    now = {"w": torch.tensor([2.0, 0.0]), "n": torch.tensor(7)}
    a = ModelUpload(weights={"w": torch.tensor([3.0, 2.0]), "n": torch.tensor(5)}, num_samples=1)
    b = ModelUpload(weights={"w": torch.tensor([1.0, 6.0]), "n": torch.tensor(5)}, num_samples=3)
    state = ModelState(weights=now)
    fresh = algo.rebase(a, ModelPayload(weights=now), state, 1.0)
    assert torch.equal(fresh.weights["w"], a.weights["w"]) and fresh.num_samples == 1
    stale = [algo.rebase(a, ModelPayload(weights=sent), state, 1.0), algo.rebase(b, ModelPayload(weights=sent),
                                                                              state, staleness_weight("polynomial", 3))]
    assert stale[0].weights["w"].tolist() == [4.0, 0.0] and stale[1].weights["w"].tolist() == [2.0, 2.0]
    new, _ = algo.server_update(state, stale, ServerContext(1, 0, torch.device("cpu"), None))
    assert new.weights["w"].tolist() == pytest.approx([(4 + 3 * 2) / 4, (0 + 3 * 2) / 4])
    assert new.weights["n"].item() == 5  # integer buffers: the clients'


def test_the_qffl_async_step_by_hand():
    """q-FFL's Delta_k is relative to the model the client received, so a stale upload keeps it and only scales it by
    its staleness weight, h_k unchanged: w_now - sum_k s_k Delta_k / sum_k h_k."""
    from fedray.methods.qffl import QFFL, QFFLUpload

    algo = QFFL(tiny_config(algorithm__name="qffl"), type("S", (), {"input_shape": (1, 4, 4), "num_classes": 2})())
    now = {"w": torch.tensor([2.0, 0.0])}
    a = QFFLUpload(delta={"w": torch.tensor([1.0, -2.0])}, h=2.0)
    b = QFFLUpload(delta={"w": torch.tensor([4.0, 4.0])}, h=3.0)
    sent = ModelPayload(weights={"w": torch.tensor([9.0, 9.0])})  # not read: Delta_k already says the change
    s = staleness_weight("polynomial", 3)
    rebased = [algo.rebase(a, sent, ModelState(weights=now), 1.0), algo.rebase(b, sent, ModelState(weights=now), s)]
    assert rebased[0].delta["w"].tolist() == [1.0, -2.0] and rebased[1].delta["w"].tolist() == [4 * s, 4 * s]
    assert [u.h for u in rebased] == [2.0, 3.0]
    new, metrics = algo.server_update(ModelState(weights=now), rebased, None)
    assert new.weights["w"].tolist() == pytest.approx([2 - (1 + 4 * s) / 5, 0 - (-2 + 4 * s) / 5])
    assert metrics["server/h_sum"] == 5.0


def test_a_method_without_async_refuses_to_rebase():
    from fedray.methods.api import Algorithm

    with pytest.raises(NotImplementedError, match="does not run async"):
        Algorithm.rebase(type("NoAsync", (), {})(), None, None, None, 1.0)


@pytest.mark.parametrize("overrides, key, message", [
    ({"federation__concurrency": 3}, "federation.concurrency", "is only read with federation.mode=async"),
    ({"federation__buffer_size": 3}, "federation.buffer_size", "is only read with federation.mode=async"),
    ({"federation__staleness": "polynomial"}, "federation.staleness", "is only read with federation.mode=async"),
    ({"federation__mode": "nosuch"}, "federation.mode", "unknown mode 'nosuch'; allowed: sync, async"),
])
def test_the_async_keys_in_synchronous_rounds_and_an_unknown_mode_are_refused_whole(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        resolve_experiment(tiny_config(**overrides))
    # a schedule registered by a test (tests/system/test_protocol.py) may follow the built-in two
    assert e.value.key == key and (e.value.message == message or e.value.message.startswith(message + ", ")), e.value


@pytest.mark.parametrize("overrides, key, fragment", [
    ({"federation__mode": "async", "system__devices": "uniform", "federation__concurrency": 99},
     "federation.concurrency", "allowed: 1..6"),
    ({"federation__mode": "async", "system__devices": "uniform", "algorithm__name": "fedkf"}, "federation.mode",
     "'fedkf' cannot run async: its server step needs one synchronous cohort (its cache and teacher"),
    ({"federation__mode": "async", "system__devices": "uniform", "algorithm__name": "dafkd"}, "federation.mode",
     "methods that can: fedavg, fedgkd, fedprox, qffl"),
    ({"federation__mode": "async", "system__devices": "uniform", "algorithm__report_model": "oca"},
     "algorithm.report_model", "report_model=aca"),
])
def test_what_cannot_run_async_is_refused_naming_why(overrides, key, fragment):
    with pytest.raises(ConfigError) as e:
        resolve_experiment(tiny_config(**overrides))
    assert e.value.key == key and fragment in e.value.message, e.value


@pytest.mark.parametrize("overrides, key, message", [
    ({}, "federation.mode", "async orders the uploads by simulated time; set system.devices to uniform, heterogeneous, "
     "trace or fedscale (docs/system.md)"),
    ({"system__devices": "uniform", "system__selection": "oort"}, "system.selection",
     "oort picks a synchronous round's clients; FedBuff dispatches uniformly among those online: set "
     "system.selection=uniform"),
    ({"system__devices": "uniform", "system__overcommit": 1.3}, "system.overcommit",
     "over-selection is for synchronous rounds; with federation.mode=async set federation.concurrency instead"),
    ({"system__devices": "uniform", "federation__buffer_size": 7}, "federation.buffer_size",
     "7 exceeds data.num_clients=6: a client's upload waits in the buffer until the step, so at most that many fit; "
     "allowed: 1..6"),
    ({"system__devices": "uniform", "federation__concurrency": 99}, "federation.concurrency",
     "99 exceeds data.num_clients=6; allowed: 1..6"),
])
def test_fedbuffs_own_refusals_read_whole(overrides, key, message):
    with pytest.raises(ConfigError) as e:
        resolve_experiment(tiny_config(federation__mode="async", **overrides))
    assert (e.value.key, e.value.message) == (key, message)


def test_a_buffer_and_a_concurrency_of_every_client_are_allowed():
    """The bounds of the two refusals above, exactly: as many uploads in the buffer, or clients in training, as
    there are clients (6)."""
    cfg = tiny_config(federation__mode="async", system__devices="uniform", federation__buffer_size=6,
                      federation__concurrency=6)
    assert cfg.data.num_clients == 6
    resolve_experiment(cfg)


@pytest.mark.ray
def test_on_ray_results_arriving_in_reverse_order_give_the_in_process_figures(ray_local, tmp_path):
    """The client fastest on the simulated clock is the slowest in wall time (tests/runtime/faulty.py): Ray returns
    its results in the reverse of the simulated order, and every figure and every row of events.parquet is still
    the in-process run's (speeds varying by step too)."""
    import tests.runtime.faulty  # noqa: F401  (registers the method)

    from fedray.record.run_dir import EVENTS_FILE

    kw = dict(algorithm__name="test_wall_order_reversed", federation__rounds=3, federation__mode="async",
              federation__concurrency=4, federation__buffer_size=2, system__devices="heterogeneous",
              federation__staleness="polynomial", system__speed_sigma=0.3, tracking__enabled=False)
    local = run_experiment(tiny_config(**kw), tmp_path / "local", progress=False)
    ray = run_experiment(tiny_config(**kw, runtime__backend="ray", runtime__num_workers=2), tmp_path / "ray",
                         progress=False)
    assert pq.read_table(tmp_path / "ray" / EVENTS_FILE).equals(pq.read_table(tmp_path / "local" / EVENTS_FILE))

    def figures(history):  # Ray counts the clients it lost (health/dropped_clients, 0 here); in process none are
        return [{k: v for k, v in row.items() if not k.startswith("time/") and k != "health/dropped_clients"}
                for row in history]

    assert figures(ray.history) == figures(local.history)
    assert sum(row["sim/staleness"] for row in local.history) > 0  # some uploads were stale


def test_an_async_run_where_no_upload_can_arrive_stops_naming_the_deadline():
    from fedray.errors import RunFailure

    cfg = tiny_config(federation__mode="async", system__devices="uniform", system__deadline_s=0.001)
    with pytest.raises(RunFailure, match="raise system.deadline_s"):
        run_experiment(cfg, progress=False)


@pytest.mark.ray
def test_on_ray_an_async_task_whose_worker_dies_runs_again_to_the_same_model(ray_local, caplog):
    """The worker training client 0 is killed mid-task (the method sleeps on a first attempt only): the task runs
    again on the restarted worker, and the server's step gives the model an in-process run gives."""
    import os
    import time
    from pathlib import Path

    import ray

    from fedray.data import build_federated_data
    from fedray.runtime.local import LocalRuntime
    from fedray.runtime.ray_runtime import RayRuntime
    from tests.runtime.faulty import GATES_ENV

    gates = Path(os.environ[GATES_ENV])
    for marker in gates.glob("slow-first-*"):
        marker.unlink()
    kw = dict(algorithm__name="test_slow_first_attempt", federation__mode="async", system__devices="uniform",
              tracking__enabled=False)
    cfg = tiny_config(**kw, runtime__backend="ray", runtime__num_workers=2)
    data = build_federated_data(cfg.data, cfg.seed)
    remote = RayRuntime(cfg, data)
    try:
        remote.start(1, [0], 0)
        deadline = time.monotonic() + 60
        while not list(gates.glob("slow-first-*-0")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(gates.glob("slow-first-*-0")), "client 0's task never started"
        ray.kill(remote.pool.workers[remote._work[0].worker], no_restart=False)
        with caplog.at_level("WARNING", logger="fedray"):
            (info,) = remote.results([0])
        assert "lost its worker" in caplog.text and info["client"] == 0
        remote.step(1, [0], [0], [1.0])
        got = remote.global_weights()
    finally:
        remote.close()
    local = LocalRuntime(tiny_config(**kw), data)
    local.start(1, [0], 0)
    local.results([0])
    local.step(1, [0], [0], [1.0])
    want = local.global_weights()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_an_async_step_sums_every_wait_for_a_client_to_come_online(tmp_path):
    """Two clients of 2.5 s work, one at a time, a buffer of 2; client 0 online [5, 8), client 1 [9, 10) and
    [12, 20): the step waits 5 s for client 0 (arrives at 7.5; its upload keeps it busy in the buffer), 1.5 s for
    client 1 (whose upload, due at 11.5, is lost when it goes offline at 10), then 2 s more: client 1 arrives at 14.5.
    The step's idle time is the three waits, 8.5 s."""
    s = _schedule(tmp_path, speeds=[4, 4], concurrency=1, buffer=2,
                  online=[(0, 5, 8), (1, 9, 10), (1, 12, 20)])
    work = _Work()
    report = s.step(1, work)
    assert work.steps == [[0, 1]] and work.dropped == [1]
    assert report.sim["sim/idle_s"] == 8.5 and report.sim["sim/dropouts"] == 1.0 and s.clock.clock == 14.5


def test_an_async_step_stops_after_a_slot_count_of_dropouts_in_a_row_naming_each_cause(tmp_path):
    """Two clients at once, deadline 5 s: client 1 (5 s of work, exactly the deadline) goes offline at 0.5 s for
    good, a dropout offline, not late; client 0 (10 s) misses every deadline. The step stops at the first dropout past
    DROPOUTS_PER_SLOT x concurrency = 200 in a row with the buffer empty: 201, of which 200 late, 1 offline, the
    fastest 5 s."""
    from fedray.errors import RunFailure
    from fedray.system.fedbuff import DROPOUTS_PER_SLOT

    s = _schedule(tmp_path, speeds=[1, 2], concurrency=2, buffer=1, deadline=5.0, online=[(0, 0, 1e9), (1, 0, 0.5)])
    work = _Work()
    with pytest.raises(RunFailure) as e:
        s.step(1, work)
    assert DROPOUTS_PER_SLOT * 2 == 200 and len(work.dropped) == 201 and not work.steps
    assert str(e.value) == (
        "round 1: 201 clients in a row dropped out and none arrived; 200 finished after system.deadline_s=5 s (the "
        "fastest in 5.0 s): raise system.deadline_s; 1 went offline before they finished: give the clients longer "
        "online periods (system.availability_trace)")
    assert e.value.resumable is False


def test_fedbuff_built_from_a_config_keeps_its_options():
    cfg = tiny_config(federation__mode="async", system__devices="uniform", federation__staleness="polynomial",
                      data__num_clients=6)
    s = FedBuff.build(cfg, 6)
    assert s.staleness == "polynomial" and s.buffer_size == cfg.federation.buffer()
    assert s.concurrency == cfg.federation.in_flight()


def test_an_async_step_stops_where_the_trace_ends_or_a_clients_work_is_lost_and_counts_no_server_work_unsaid(
        tmp_path):
    """Nobody online from 5 s on and none training: the step cannot dispatch (not resumable as it is); a work
    whose figures never come (its worker failed past its retries) stops the run, resumable from its checkpoint; a
    server step that reports no sim/server_samples takes no server time."""
    from fedray.errors import RunFailure

    ended = _schedule(tmp_path, speeds=[10, 10], concurrency=2, buffer=1, online=[(0, 0, 1), (1, 0, 1)])
    ended.clock.clock = 5.0
    with pytest.raises(RunFailure) as e:
        ended.dispatch()
    assert str(e.value) == ("no client can train at simulated time 5 s or later (the availability trace ends); give a "
                            "longer system.availability_trace or fewer rounds") and e.value.resumable is False

    class Lost(_Work):
        def results(self, client_ids):
            return [None for _ in client_ids]

    lost = _schedule(tmp_path, speeds=[10, 10], concurrency=1, buffer=1)
    with pytest.raises(RunFailure) as e:
        lost.step(1, Lost())
    assert e.value.resumable is True and str(e.value) == (
        f"client {sorted(lost.flight)[0]}'s work was lost (its worker failed past runtime.max_client_retries); "
        "resume the run from its last checkpoint")

    class Unsaid(_Work):
        def step(self, round_, client_ids, versions, weights):
            from fedray.system import Step

            return Step([{} for _ in client_ids], {})

    quiet = _schedule(tmp_path, speeds=[10, 5], concurrency=2, buffer=1, server_sps=500.0)
    report = quiet.step(1, Unsaid())
    assert report.sim["sim/server_s"] == 0.0 and report.sim["sim/round_s"] == 1.0
