"""The virtual clock of a synchronous round, by hand: each selected client's time, who arrives, who straggles, who
drops out, how long the round takes, and who may be sampled at all."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedray.errors import RunFailure
from fedray.system import SystemClock, SystemConfig
from fedray.system.availability import Markov

MB = 1e6 / 8  # bytes per second in one Mbit/s


def _trace(tmp_path, rows, name="devices.csv"):
    path = tmp_path / name
    path.write_text("client,compute_sps,up_mbps,down_mbps,latency_ms\n" + "\n".join(",".join(map(str, r)) for r in rows))
    return str(path)


def _availability(tmp_path, rows):
    path = tmp_path / "online.csv"
    path.write_text("client,start_s,end_s\n" + "\n".join(",".join(map(str, r)) for r in rows))
    return str(path)


def _clock(tmp_path, rows, per_round, **system):
    cfg = SystemConfig(devices="trace", trace=_trace(tmp_path, rows), **system)
    return SystemClock(cfg, len(rows), per_round, seed=0)


def test_a_three_client_round_by_hand(tmp_path):
    """t_k = latency + down / down_k + samples / sps_k + latency + up / up_k; the round ends with the last of the k."""
    rows = [(0, 100, 8, 16, 10), (1, 50, 4, 8, 20), (2, 200, 16, 32, 0)]
    clock = _clock(tmp_path, rows, per_round=3)
    assert clock.select(1) == [0, 1, 2]
    down, samples, up = 2_000_000, [300, 300, 1000], [1_000_000, 1_000_000, 4_000_000]
    assert clock.admit([0, 1, 2], samples, up, down) == [0, 1, 2]
    t = [0.010 + down / (16 * MB) + 300 / 100 + 0.010 + 1_000_000 / (8 * MB),  # 5.02
         0.020 + down / (8 * MB) + 300 / 50 + 0.020 + 1_000_000 / (4 * MB),  # 10.04
         0.0 + down / (32 * MB) + 1000 / 200 + 0.0 + 4_000_000 / (16 * MB)]  # 7.5
    row = clock.end_round(0)
    assert row["sim/round_s"] == pytest.approx(max(t), rel=1e-12) and row["sim/round_s"] == pytest.approx(10.04)
    assert row["sim/clock_s"] == row["sim/round_s"]
    assert (row["sim/available"], row["sim/selected"], row["sim/stragglers"], row["sim/dropouts"]) == (3, 3, 0, 0)
    cols = clock.client_columns([0, 1, 2])
    assert cols["sim_rounds"].tolist() == [1, 1, 1]
    assert cols["sim_busy_s"] == pytest.approx(t)


def test_overcommitment_aggregates_exactly_the_k_earliest(tmp_path):
    """ceil(2 x 2.5) = 5 selected; the two fastest arrive, the other three straggle; the round ends with the 2nd."""
    rows = [(c, sps, 1000, 1000, 0) for c, sps in enumerate([10, 50, 20, 40, 30])]
    clock = _clock(tmp_path, rows, per_round=2, overcommit=2.5)
    assert clock.select(1) == [0, 1, 2, 3, 4]
    assert clock.admit([0, 1, 2, 3, 4], [100] * 5, [0] * 5, 0) == [1, 3]
    row = clock.end_round(0)
    assert row["sim/round_s"] == pytest.approx(100 / 40) and row["sim/stragglers"] == 3 and row["sim/dropouts"] == 0
    # a straggler worked until the server stopped waiting
    assert clock.client_columns([0, 1, 3])["sim_busy_s"] == pytest.approx([2.5, 2.0, 2.5])
    assert clock.client_columns(range(5))["sim_rounds"].tolist() == [0, 1, 0, 1, 0]


@pytest.mark.parametrize("per_round,overcommit,selected", [(2, 1.3, 3), (3, 1.1, 4), (2, 1.5, 3), (4, 1.25, 5)])
def test_overcommitment_selects_the_product_rounded_up(tmp_path, per_round, overcommit, selected):
    """ceil(k x overcommit): 2.6 -> 3, 3.3 -> 4 (a product that is not a whole number is rounded up, not down), and a
    whole product in floating point (2 x 1.5, 4 x 1.25) exactly itself."""
    clock = _clock(tmp_path, [(c, 10, 1000, 1000, 0) for c in range(8)], per_round=per_round, overcommit=overcommit,
                   availability="always", selection="uniform")
    from fedray.seeding import derive_rng

    # every client online, a uniform draw of the round's seeded stream
    want = np.sort(derive_rng(0, "sample", 1).choice(np.arange(8), size=selected, replace=False)).tolist()
    assert clock.select(1) == want and len(want) == selected


def test_a_tie_goes_to_the_lower_client_id(tmp_path):
    clock = _clock(tmp_path, [(c, 10, 1000, 1000, 0) for c in range(3)], per_round=1, overcommit=3)
    clock.select(1)
    assert clock.admit([0, 1, 2], [10, 10, 10], [0] * 3, 0) == [0]


def test_a_deadline_drops_exactly_the_late_ones_and_ends_the_round(tmp_path):
    rows = [(c, sps, 1000, 1000, 0) for c, sps in enumerate([10, 20, 40, 100])]
    clock = _clock(tmp_path, rows, per_round=4, deadline_s=5.0)
    clock.select(1)
    # times 10, 5, 2.5, 1: client 1 at exactly the deadline is in time; client 0 is late
    assert clock.admit([0, 1, 2, 3], [100] * 4, [0] * 4, 0) == [1, 2, 3]
    row = clock.end_round(0)
    assert row["sim/dropouts"] == 1 and row["sim/stragglers"] == 0
    assert row["sim/round_s"] == 5.0  # fewer than k arrived: the server waited for the deadline
    clock.select(2)
    assert clock.admit([0, 1, 2, 3], [100, 100, 100, 10], [0] * 4, 0) == [1, 2, 3]
    assert clock.end_round(0)["sim/round_s"] == 5.0


def test_going_offline_as_the_work_ends_arrives_and_offline_before_a_deadline_finish_is_offline(tmp_path):
    """Client 0's work ends at 1 s, the moment it goes offline: it arrives. Client 1's would end at 5 s, exactly the
    deadline, but it goes offline at 4 s: a dropout for going offline (not late, not arrived)."""
    online = _availability(tmp_path, [(0, 0, 1.0), (1, 0, 4.0)])
    clock = _clock(tmp_path, [(0, 10, 1000, 1000, 0), (1, 2, 1000, 1000, 0)], per_round=2, deadline_s=5.0,
                   availability="trace", availability_trace=online)
    assert clock.select(1) == [0, 1]
    assert clock.admit([0, 1], [10, 10], [0, 0], 0) == [0]
    assert clock._round["events"]["outcome"].tolist() == ["aggregated", "dropout_offline"]
    assert clock._round["events"]["client"].tolist() == [0, 1] and clock._round["events"]["client"].dtype == np.int64
    row = clock.end_round(0)
    assert (row["sim/dropouts"], row["sim/stragglers"], row["sim/round_s"]) == (1, 0, 4.0)


def test_a_round_none_of_whose_work_came_back_waits_for_no_one(tmp_path):
    """Every selected client's work lost (none admitted): the round costs only the server's time and the lost count
    as dropouts; ending a round before admitting is refused."""
    clock = _clock(tmp_path, [(0, 10, 1000, 1000, 0), (1, 10, 1000, 1000, 0)], per_round=2)
    clock.select(1)
    with pytest.raises(AssertionError, match="^admit comes before end_round$"):
        clock.end_round(0)
    clock.select(1)
    assert clock.admit([], [], [], 0) == []
    row = clock.end_round(0)
    assert (row["sim/round_s"], row["sim/selected"], row["sim/dropouts"]) == (0.0, 2, 2)


def test_the_clients_columns_of_no_client_are_empty(tmp_path):
    """clients.parquet's columns for an empty list of clients: empty, not an indexing error (an empty list is a float
    array to numpy unless told otherwise)."""
    clock = _clock(tmp_path, [(0, 10, 1000, 1000, 0)], per_round=1)
    cols = clock.client_columns([])
    assert cols["sim_rounds"].size == 0 and cols["sim_busy_s"].size == 0


def test_the_servers_work_is_timed_after_the_last_arrival(tmp_path):
    clock = _clock(tmp_path, [(0, 10, 1000, 1000, 0)], per_round=1, server_sps=500.0)
    clock.select(1)
    clock.admit([0], [20], [0], 0)
    row = clock.end_round(1000)
    assert row["sim/server_s"] == 2.0 and row["sim/round_s"] == 4.0 and clock.clock == 4.0


def test_an_offline_client_is_never_sampled_and_a_mid_round_dropout_is_not_aggregated(tmp_path):
    rows = [(c, 10, 1000, 1000, 0) for c in range(4)]
    online = _availability(tmp_path, [(0, 0, 1.0), (1, 0, 100), (2, 0, 100), (3, 50, 100), (0, 60, 70)])
    clock = _clock(tmp_path, rows, per_round=3, availability="trace", availability_trace=online)
    assert clock.select(1) == [0, 1, 2]  # client 3 comes online at 50 s
    # client 0 goes offline at 1 s, before its 2 s of work: a dropout
    assert clock.admit([0, 1, 2], [20] * 3, [0] * 3, 0) == [1, 2]
    row = clock.end_round(0)
    assert row["sim/dropouts"] == 1 and row["sim/available"] == 3 and row["sim/round_s"] == 2.0
    assert clock.client_columns([0])["sim_busy_s"] == pytest.approx([1.0])  # it worked until it went
    seen = set()
    for r in range(2, 6):  # rounds of 20 s: client 0 only in [60, 70), client 3 only from 50 s on
        chosen = clock.select(r)
        seen.update(chosen)
        assert (0 not in chosen or 60 <= clock.clock < 70) and (3 not in chosen or clock.clock >= 50)
        clock.admit(chosen, [200] * len(chosen), [0] * len(chosen), 0)
        clock.end_round(0)
    assert 3 in seen


def test_with_nobody_online_the_clock_waits_and_a_trace_that_ends_stops_the_run(tmp_path):
    rows = [(0, 10, 1000, 1000, 0)]
    online = _availability(tmp_path, [(0, 30, 40)])
    clock = _clock(tmp_path, rows, per_round=1, availability="trace", availability_trace=online)
    assert clock.select(1) == [0]
    clock.admit([0], [10], [0], 0)
    row = clock.end_round(0)
    assert row["sim/round_s"] == 31.0 and row["sim/clock_s"] == 31.0  # waited 30 s, worked 1 s
    assert row["sim/idle_s"] == 30.0  # the wait, a figure of its own
    with pytest.raises(RunFailure, match=r"^round \d+: no client is online at simulated time \d+ s or later \(the "
                       r"availability trace ends\); give a longer system.availability_trace or fewer rounds$") as e:
        for r in range(2, 20):
            clock.select(r)
            clock.admit([0], [10], [0], 0)
            clock.end_round(0)
    assert e.value.resumable is False  # a resume meets the trace's end again


def test_rounds_whose_clients_all_go_offline_stop_the_run_counting_them(tmp_path):
    """Online half a second from each whole second, a client whose work takes 1 s goes offline in every round: after
    DRY_ROUNDS such rounds the stop counts them all as gone offline (none late) and names the trace."""
    from fedray.system.clock import DRY_ROUNDS

    online = _availability(tmp_path, [(0, k, k + 0.5) for k in range(2 * DRY_ROUNDS)])
    clock = _clock(tmp_path, [(0, 10, 1000, 1000, 0)], per_round=1, availability="trace",
                   availability_trace=online)
    with pytest.raises(RunFailure) as e:
        for r in range(1, DRY_ROUNDS + 1):
            clock.select(r)
            assert clock.admit([0], [10], [0], 0) == []
            clock.end_round(0)
    assert str(e.value) == (f"round {DRY_ROUNDS}: no upload arrived in {DRY_ROUNDS} rounds in a row; {DRY_ROUNDS} went "
                            "offline before they finished: give the clients longer online periods "
                            "(system.availability_trace)")


def test_rounds_in_which_no_upload_arrives_stop_the_run_naming_the_key(tmp_path):
    """An impossible deadline: after DRY_ROUNDS rounds without an arrival the run stops, naming system.deadline_s
    and the fastest client's time; one arrival in between starts the count again, and the count is resumed."""
    from fedray.system.clock import DRY_ROUNDS

    clock = _clock(tmp_path, [(0, 10, 1000, 1000, 0), (1, 5, 1000, 1000, 0)], per_round=2, deadline_s=1.5)
    for r in range(1, DRY_ROUNDS):  # client 0 needs 1 s, client 1 2 s: only client 1's samples are too many
        clock.select(r)
        assert clock.admit([0, 1], [20, 10], [0, 0], 0) == []  # 2 s and 2 s: both late
        clock.end_round(0)
    clock.select(DRY_ROUNDS)
    assert clock.admit([0, 1], [10, 10], [0, 0], 0) == [0]  # an arrival: the count starts again
    clock.end_round(0)
    again = _clock(tmp_path, [(0, 10, 1000, 1000, 0), (1, 5, 1000, 1000, 0)], per_round=2, deadline_s=1.5)
    for r in range(DRY_ROUNDS + 1, 2 * DRY_ROUNDS + 1):
        if r == DRY_ROUNDS + 3:  # resumed mid-count
            again.load(clock.state())
            clock = again
        clock.select(r)
        if r < 2 * DRY_ROUNDS:
            clock.admit([0, 1], [20, 10], [0, 0], 0)
            clock.end_round(0)
    with pytest.raises(RunFailure) as e:
        clock.admit([0, 1], [20, 10], [0, 0], 0)
    assert str(e.value) == (f"round {2 * DRY_ROUNDS}: no upload arrived in {DRY_ROUNDS} rounds in a row; "
                            f"{2 * DRY_ROUNDS} finished after system.deadline_s=1.5 s (the fastest in 2.0 s): "
                            "raise system.deadline_s")
    assert not e.value.resumable


def test_with_fewer_than_k_selected_the_round_ends_when_the_last_is_in(tmp_path):
    """Two clients online for k = 3 and a 20 s deadline: the server stops waiting at the last arrival, not at 20 s;
    a client that goes offline is known gone when it goes."""
    rows = [(c, sps, 1000, 1000, 0) for c, sps in enumerate([10, 20, 10])]
    online = _availability(tmp_path, [(0, 0, 100), (1, 0, 100), (2, 0, 3.0)])
    clock = _clock(tmp_path, rows, per_round=4, deadline_s=20.0, availability="trace", availability_trace=online)
    assert clock.select(1) == [0, 1, 2]
    assert clock.admit([0, 1, 2], [50, 50, 50], [0] * 3, 0) == [0, 1]  # client 2 would need 5 s, gone at 3 s
    assert clock.end_round(0)["sim/round_s"] == 5.0


def test_clients_lost_by_the_runtime_count_as_dropouts(tmp_path):
    clock = _clock(tmp_path, [(c, 10, 1000, 1000, 0) for c in range(3)], per_round=3)
    clock.select(1)
    assert clock.admit([0, 2], [10, 10], [0, 0], 0) == [0, 2]  # client 1's worker failed for good
    assert clock.end_round(0)["sim/dropouts"] == 1


def test_markov_availability_is_stationary_and_seeded():
    """At every time a client is online with probability on / (on + off); the same seed, the same states."""
    a, b = Markov(4000, 100.0, 300.0, seed=1), Markov(4000, 100.0, 300.0, seed=1)
    fractions = []
    for t in (0.0, 50.0, 500.0, 5000.0):
        online, until = a.at(t)
        assert np.array_equal(online, b.at(t)[0])
        assert (until[online] > t).all() and np.isneginf(until[~online]).all()
        fractions.append(online.mean())
    assert np.mean(fractions) == pytest.approx(0.25, abs=0.02)
    other = Markov(4000, 100.0, 300.0, seed=2).at(0.0)[0]
    assert not np.array_equal(other, Markov(4000, 100.0, 300.0, seed=1).at(0.0)[0])


def test_markov_periods_have_the_asked_means():
    """Watched on a fine grid, a client's online periods last mean_online_s on average."""
    m = Markov(1000, 20.0, 60.0, seed=0)
    prev, _ = m.at(0.0)
    ends = np.zeros(1000)
    for t in np.arange(1.0, 2000.0, 1.0):
        now, _ = m.at(float(t))
        ends += prev & ~now
        prev = now
    # a client spends ~1/4 of 2000 s online in periods of ~20 s: ~25 online periods end per client
    assert ends.mean() == pytest.approx(2000 / 80, rel=0.05)


def test_the_clock_state_round_trips(tmp_path):
    def clock():
        cfg = SystemConfig(devices="uniform", availability="markov", mean_online_s=5.0, mean_offline_s=5.0)
        return SystemClock(cfg, 50, 5, seed=3)

    a = clock()
    for r in (1, 2):
        ids = a.select(r)
        a.admit(ids, [100] * len(ids), [1000] * len(ids), 1000)
        a.end_round(0)
    b = clock()
    b.load(a.state())
    for r in (3, 4):
        ids = a.select(r)
        assert b.select(r) == ids
        assert a.admit(ids, [100] * len(ids), [1000] * len(ids), 1000) == b.admit(ids, [100] * len(ids),
                                                                              [1000] * len(ids), 1000)
        assert a.end_round(0) == b.end_round(0)
    # a checkpoint written before the count of rounds without an arrival existed: the count starts from none
    old = {k: v for k, v in a.state().items() if k != "dry"}
    c = clock()
    c.load(old)
    assert c.dry == clock().dry and c.select(5) == a.select(5)


def test_uniform_devices_and_the_heterogeneous_profile():
    uniform = SystemClock(SystemConfig(devices="uniform", compute_sps=7, up_mbps=8, down_mbps=16, latency_ms=5),
                          3, 1, seed=0).devices
    assert uniform.compute_sps.tolist() == [7] * 3 and uniform.up_bps.tolist() == [1e6] * 3
    assert uniform.down_bps.tolist() == [2e6] * 3 and uniform.latency_s.tolist() == [0.005] * 3
    het = SystemClock(SystemConfig(devices="heterogeneous"), 20000, 1, seed=0).devices
    assert np.median(het.compute_sps) == pytest.approx(17.0, rel=0.03)
    assert np.std(np.log(het.up_bps)) == pytest.approx(0.70, rel=0.03)
    again = SystemClock(SystemConfig(devices="heterogeneous"), 20000, 1, seed=0).devices
    assert np.array_equal(het.compute_sps, again.compute_sps)
    assert not np.array_equal(het.compute_sps, SystemClock(SystemConfig(devices="heterogeneous"), 20000, 1,
                                                           seed=1).devices.compute_sps)
    assert math.isclose(np.median(het.latency_s), 0.035, rel_tol=0.03)


def test_the_event_record_of_a_round_by_hand(tmp_path):
    """Five selected for one upload (over-commitment 5): client 0 arrives first, client 1 straggles, client 2 goes
    offline at 3 s, client 3 passes the 12 s deadline, client 4's work is lost by the runtime. Each row: the round's
    start, when its fate was settled, t_k and its parts, its fate."""
    rows = [(0, 100, 8, 8, 10), (1, 50, 8, 8, 10), (2, 100, 8, 8, 10), (3, 10, 8, 8, 10), (4, 100, 8, 8, 10)]
    online = _availability(tmp_path, [(0, 0, 1e6), (1, 0, 1e6), (2, 0, 3), (3, 0, 1e6), (4, 0, 1e6)])
    clock = _clock(tmp_path, rows, per_round=1, overcommit=5.0, deadline_s=12.0, availability="trace",
                   availability_trace=online)
    assert clock.select(1) == [0, 1, 2, 3, 4]
    down, up = 1_000_000, 2_000_000
    assert clock.admit([0, 1, 2, 3], [400, 400, 400, 400], [up] * 4, down) == [0]
    clock.end_round(0)
    ev = clock.last_events
    transfer = 0.020 + down / (8 * MB) + up / (8 * MB)  # both latencies, 1 s down, 2 s up
    t = [transfer + 400 / sps for sps in (100, 50, 100, 10)]  # 7.02, 11.02, 7.02, 43.02
    assert ev["client"].tolist() == [0, 1, 2, 3, 4]
    assert ev["outcome"].tolist() == ["aggregated", "straggler", "dropout_offline", "dropout_deadline", "lost"]
    assert ev["t_s"][:4] == pytest.approx(t) and math.isnan(ev["t_s"][4])
    assert ev["compute_s"][:4] == pytest.approx([4, 8, 4, 40]) and ev["download_s"][:4] == pytest.approx([1] * 4)
    assert ev["upload_s"][:4] == pytest.approx([2] * 4) and ev["latency_s"][:4] == pytest.approx([0.02] * 4)
    # settled: its arrival; the straggler's too; going offline at 3 s; the deadline at 12 s
    assert ev["end_s"][:4] == pytest.approx([t[0], t[1], 3.0, 12.0]) and (ev["start_s"] == 0).all()


def test_speeds_that_vary_are_seeded_per_round_and_client_around_the_device(tmp_path):
    """system.speed_sigma: t_k's compute part is samples / (sps x exp(sigma z)) with z drawn per (run seed, round,
    client): the same whoever else is selected and after a resume, another each round, its median the device's;
    sigma = 0 gives the fixed speeds exactly."""
    from fedray.system.devices import Devices

    rows = [(c, 100, 8, 8, 10) for c in range(4)]
    cfg = lambda sigma: SystemConfig(devices="trace", trace=_trace(tmp_path, rows), speed_sigma=sigma)  # noqa: E731
    dev = Devices.build(cfg(0.5), 4, seed=3)
    one = dev.time_parts(np.array([2]), np.array([100.0]), np.array([1e6]), np.array([1e6]), 7)
    many = dev.time_parts(np.array([0, 2, 3]), np.full(3, 100.0), np.full(3, 1e6), np.full(3, 1e6), 7)
    assert many["compute_s"][1] == one["compute_s"][0] and many["upload_s"][1] == one["upload_s"][0]
    again = Devices.build(cfg(0.5), 4, seed=3).time_parts(np.array([2]), np.array([100.0]), np.array([1e6]),
                                                           np.array([1e6]), 7)
    assert again["compute_s"][0] == one["compute_s"][0]  # a resumed run draws the same
    total = dev.client_time(np.array([2]), np.array([100.0]), np.array([1e6]), np.array([1e6]), 7)[0]
    assert total == pytest.approx(sum(part[0] for part in one.values()), rel=1e-12)  # t_k of round 7's speeds
    compute = np.array([dev.time_parts(np.array([1]), np.array([100.0]), np.array([0.0]), np.array([0.0]), r)
                        ["compute_s"][0] for r in range(1, 2001)])
    assert len(set(compute.tolist())) == 2000  # another draw each round
    assert np.median(compute) == pytest.approx(1.0, rel=0.05)  # 100 samples at a median 100 samples/s
    assert np.std(np.log(compute)) == pytest.approx(0.5, rel=0.05)
    fixed = Devices.build(cfg(0.0), 4, seed=3)
    assert fixed.client_time(np.array([1]), np.array([100.0]), np.array([1e6]), np.array([1e6]), 7)[0] == \
        fixed.client_time(np.array([1]), np.array([100.0]), np.array([1e6]), np.array([1e6]))[0]


def test_a_fresh_clock_has_no_round_and_refuses_admit_before_select(tmp_path):
    clock = _clock(tmp_path, [(0, 10, 1000, 1000, 0)], per_round=1)
    assert clock.last_events is None  # no round's rows yet
    with pytest.raises(AssertionError, match="^select comes first$"):
        clock.admit([0], [10], [0], 0)
