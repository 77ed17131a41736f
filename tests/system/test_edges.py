"""The availability models and the clock's stop at their edges: a time exactly at an interval's start or end, a
time a rounding error short of a cycle's end, nobody online, nobody ever changing; and what the stop names."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from fedray.system.availability import CyclicTrace, Markov, TraceAvailability
from fedray.system.clock import SystemClock


def test_a_trace_changes_strictly_after_the_time_asked_its_intervals_end_exclusive():
    """Client 0 online [10, 20), client 1 [20, 30): at 10 the next change is 20 (not 10 itself); at 20 it is 30;
    at 20 client 0 is offline and client 1 online until 30."""
    trace = TraceAvailability(2, np.array([0, 1]), np.array([10.0, 20.0]), np.array([20.0, 30.0]))
    assert trace.next_change(10.0) == 20.0 and trace.next_change(20.0) == 30.0 and trace.next_change(30.0) == math.inf
    online, until = trace.at(20.0)
    assert online.tolist() == [False, True] and until[1] == 30.0
    assert trace.next_online(5.0) == 10.0 and trace.next_online(10.0) == 10.0 and trace.next_online(30.0) == math.inf


def test_markov_keeps_its_time_and_with_nobody_online_waits_for_the_first_to_come_back():
    chain = Markov(3, 10.0, 10.0, seed=0)
    chain.online[:], chain.until[:] = False, [7.0, 4.0, 9.0]  # all offline, back at 7, 4 and 9
    assert chain.next_online(1.0) == 4.0 and chain.next_change(1.0) == 4.0
    assert chain.state()["time"] == 1.0
    online, until = chain.at(5.0)  # client 1 came back at 4: online until 4 + an exponential draw
    assert online.tolist() == [False, True, False] and until[1] > 5.0 and chain.state()["time"] == 5.0
    assert chain.next_online(5.0) == 5.0 and chain.next_change(5.0) == min(7.0, until[1])


def test_every_model_gives_an_offline_client_no_online_period():
    """at(t)'s second array, the end of each client's current online period, is -inf for a client offline at t in
    every model (the clock reads it for the clients it selects, all online)."""
    models = [Markov(4, 10.0, 10.0, seed=1),
              TraceAvailability(3, np.array([0, 2]), np.array([0.0, 8.0]), np.array([5.0, 9.0])),
              CyclicTrace(3, np.array([0, 2]), np.array([0.0, 8.0]), np.array([5.0, 9.0]), np.full(3, 10.0))]
    for model in models:
        for t in (0.0, 3.0, 8.5, 23.0):
            online, until = model.at(t)
            assert until.dtype == np.float64 and (until[~online] == -math.inf).all() and (until[online] > t).all()
            assert (~online).any() or isinstance(model, Markov)
    assert models[2].at(23.0)[1].tolist() == [25.0, -math.inf, -math.inf]


def test_a_cyclic_trace_a_rounding_error_short_of_the_cycles_end_reads_as_the_next_cycles_start():
    """Online [0, 5) of a 10 s cycle: at 30 - 5e-10 s (t mod 10 rounds to just under 10) the client is online, until
    35, as at 30 itself."""
    cyc = CyclicTrace(1, np.array([0]), np.array([0.0]), np.array([5.0]), np.array([10.0]))
    for t in (30.0 - 5e-10, 30.0):
        online, until = cyc.at(t)
        assert online.dtype == bool and online.tolist() == [True] and until.tolist() == [35.0]
    assert cyc.at(35.0)[0].tolist() == [False]


def test_a_cyclic_trace_online_the_whole_cycle_never_changes_and_an_empty_one_is_never_online():
    always = CyclicTrace(1, np.array([0]), np.array([0.0]), np.array([10.0]), np.array([10.0]))
    assert always.next_change(3.0) == math.inf and always.at(25.0)[1].tolist() == [math.inf]
    empty = CyclicTrace(2, np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.array([10.0, 10.0]))
    assert empty.next_online(3.0) == math.inf and not empty.at(3.0)[0].any()


@pytest.mark.parametrize("availability, key", [
    ("markov", "system.mean_online_s"), ("trace", "system.availability_trace"),
    ("fedscale", "system.availability_trace"), ("always", "system.availability")])
def test_the_stop_names_the_key_that_lengthens_online_periods_of_each_availability_model(availability, key):
    clock = SimpleNamespace(cfg=SimpleNamespace(availability=availability, deadline_s=2.0),
                            dry={"late": 0, "offline": 3, "fastest": 1.5})
    stop = SystemClock.no_arrivals(clock, "round 9")
    assert str(stop) == f"round 9; 3 went offline before they finished: give the clients longer online periods ({key})"
    both = SystemClock.no_arrivals(clock, "round 9", late=1, offline=2, fastest=4.0)
    assert str(both) == ("round 9; 1 finished after system.deadline_s=2 s (the fastest in 4.0 s): raise "
                         f"system.deadline_s; 2 went offline before they finished: give the clients longer online "
                         f"periods ({key})")
    assert str(SystemClock.no_arrivals(clock, "round 9", offline=0)) == "round 9; no client finished its work"


# --- the trace readers at their edges --------------------------------------------------------------------------------

def _csv(tmp_path, header, rows):
    path = tmp_path / "t.csv"
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return str(path)


def _refused(read, *args):
    from fedray.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        read(*args)
    assert e.value.key == "k"
    return str(e.value).split("t.csv: ", 1)[1]  # the message after the path


DEVICES = "client,compute_sps,up_mbps,down_mbps,latency_ms"


@pytest.mark.parametrize("rows, message", [
    (["0,1,1,1,0", "1,1,1,1,5", "0,2,1,1,5"], "row 3: client 0 is listed again (first in row 1); give one row per "
     "client"),
    (["0,1,1,1,0", "2,1,1,1,5"], "row 2, column client: 2 is not a client id; allowed: 0..1 (data.num_clients=2)"),
    (["0,1,1,1,0", "1.5,1,1,1,0"], "row 2, column client: 1.5 is not a client id; allowed: 0..1 "
     "(data.num_clients=2)"),
    (["-1,1,1,1,0", "1,1,1,1,0"], "row 1, column client: -1 is not a client id; allowed: 0..1 (data.num_clients=2)"),
    (["1,1,1,1,0"], "client 0 has no row (1 of data.num_clients=2 missing); give one row per client id 0..1"),
    (["0,1,1,1,0", "1,1,1,1,-1"], "row 2, column latency_ms: -1; must be >= 0"),
    (["0,1,1,1,0", "1,1,0,1,0"], "row 2, column up_mbps: 0; must be > 0"),
], ids=["again-row-1", "id-at-n", "id-not-whole", "id-negative", "missing", "latency", "zero-speed"])
def test_a_device_trace_is_refused_at_each_edge_naming_the_row(rows, message, tmp_path):
    from fedray.system.traces import read_device_trace

    path = _csv(tmp_path, DEVICES, rows)
    assert _refused(read_device_trace, "k", path, 2) == message
    read_device_trace("k", _csv(tmp_path, DEVICES, ["1,1,1,1,0", "0,2,1,1,0"]), 2)  # 0 latency, any order: fine


@pytest.mark.parametrize("rows, message", [
    (["0,0,10", "1,-1,5"], "row 2, column start_s: -1; must be >= 0"),
    (["0,0,10", "1,2,-5"], "row 2, column end_s: -5; must be >= 0"),
    (["0,0,10", "1,5,5"], "row 2, column end_s: 5 is not after start_s=5"),
    (["1,0,5", "0,20,30", "0,0,25"], "row 2, column start_s: client 0's interval [20, 30) overlaps row 3's [0, 25); "
     "merge them"),
    (["0,0,10", "1,0,25", "1,20,30"], "row 3, column start_s: client 1's interval [20, 30) overlaps row 2's [0, 25); "
     "merge them"),
    (["0,0,10", "2,0,5"], "row 2, column client: 2 is not a client id; allowed: 0..1 (data.num_clients=2)"),
], ids=["start", "end", "zero-length", "overlap", "overlap-second-client", "id-at-n"])
def test_an_availability_trace_is_refused_at_each_edge_naming_the_row(rows, message, tmp_path):
    from fedray.system.traces import read_availability_trace

    assert _refused(read_availability_trace, "k", _csv(tmp_path, "client,start_s,end_s", rows), 2) == message


def test_the_configs_check_reads_each_fedray_trace_it_names(tmp_path):
    """check_traces (the config's check, before any work) refuses a bad system.trace under system.devices=trace and
    a bad system.availability_trace under system.availability=trace, naming the key."""
    from fedray.errors import ConfigError
    from fedray.system import SystemConfig, check_traces

    devices, online = tmp_path / "devices", tmp_path / "online"
    devices.mkdir(), online.mkdir()
    good = _csv(devices, DEVICES, ["0,1,1,1,0", "1,1,1,1,0"])
    bad_devices = _csv(tmp_path, DEVICES, ["1,1,1,1,0"])
    bad_online = _csv(online, "client,start_s,end_s", ["0,0,10", "1,5,5"])
    for cfg, key in [(SystemConfig(devices="trace", trace=bad_devices), "system.trace"),
                     (SystemConfig(devices="trace", trace=good, availability="trace", availability_trace=bad_online),
                      "system.availability_trace")]:
        with pytest.raises(ConfigError) as e:
            check_traces(cfg, 2)
        assert e.value.key == key
    check_traces(SystemConfig(devices="trace", trace=good), 2)


def test_a_trace_file_missing_empty_or_rewritten(tmp_path):
    """A path that is no file, and an empty file, refused naming the key and the file; a cell Python reads as a
    number and pyarrow does not (1_000) read as that number; a file rewritten to another size at the same
    modification time read again (the reader caches by path, time and size)."""
    import os

    from fedray.errors import ConfigError
    from fedray.system.traces import read_availability_trace

    missing = tmp_path / "none.csv"
    with pytest.raises(ConfigError) as e:
        read_availability_trace("k", str(missing), 2)
    assert e.value.key == "k" and e.value.message == (
        f"{missing} is not a file; give a CSV or parquet file with columns client, start_s, end_s")
    empty = tmp_path / "t.csv"
    empty.write_text("")
    with pytest.raises(ConfigError) as e:
        read_availability_trace("k", str(empty), 2)
    assert e.value.key == "k" and e.value.message == f"{empty} is not a readable CSV or parquet file (Empty CSV file)"
    path = _csv(tmp_path, "client,start_s,end_s", ["0,0,1_000", "1,5,20"])
    mtime = os.stat(path).st_mtime_ns
    assert read_availability_trace("k", path, 2)[2].tolist() == [1000, 20]
    _csv(tmp_path, "client,start_s,end_s", ["0,0,1_000", "1,5,200"])
    os.utime(path, ns=(mtime, mtime))
    assert read_availability_trace("k", path, 2)[2].tolist() == [1000, 200]


def test_touching_intervals_read_as_one_and_apart_ones_as_two(tmp_path):
    from fedray.system.traces import read_availability_trace

    rows = ["1,7,9", "0,10,50", "0,0,10", "0,60,70", "1,0,7"]
    client, start, end = read_availability_trace("k", _csv(tmp_path, "client,start_s,end_s", rows), 2)
    assert client.tolist() == [0, 0, 1] and start.tolist() == [0, 60, 0] and end.tolist() == [50, 70, 9]


def test_the_online_seconds_are_those_of_the_runs_own_seeded_process():
    """online_seconds walks the availability process of the run's seed: another seed, other seconds; each client
    online at 0 in the clock's own process has seconds online from 0 on."""
    from fedray.system import SystemConfig
    from fedray.system.clock import online_seconds

    cfg = SystemConfig(devices="uniform", availability="markov", mean_online_s=10.0, mean_offline_s=20.0)
    seconds = {seed: online_seconds(cfg, 6, seed, 100.0) for seed in (0, 1)}
    assert seconds[0].tolist() != seconds[1].tolist()
    for seed, online in seconds.items():
        at_zero, until = SystemClock(cfg, 6, 2, seed).availability.at(0.0)
        assert (online[at_zero] >= np.minimum(until[at_zero], 100.0)).all() and (online <= 100.0).all()


def test_a_rounds_speeds_are_each_clients_own_lognormal_draws_by_hand():
    """system.speed_sigma = 0.5, round 4: client c's compute speed is multiplied by exp(0.5 z), z from the stream
    (seed, "speeds", 4, "compute", c), its network's (up and down alike) by its "network" draw; a client alone draws
    what it draws beside others; without a round (or sigma 0) the base speeds."""
    from fedray.seeding import derive_rng
    from fedray.system import SystemConfig
    from fedray.system.devices import Devices

    dev = Devices.build(SystemConfig(devices="heterogeneous", speed_sigma=0.5), num_clients=3, seed=7)
    ids, samples = np.array([2, 0]), np.array([10.0, 20.0])
    down, up = np.array([1e6, 2e6]), np.array([3e5, 4e5])
    parts = dev.time_parts(ids, samples, down, up, 4)
    for k, c in enumerate(ids):
        f = {what: math.exp(0.5 * derive_rng(7, "speeds", 4, what, int(c)).standard_normal())
             for what in ("compute", "network")}
        assert parts["compute_s"][k] == pytest.approx(samples[k] / (dev.compute_sps[c] * f["compute"]), rel=1e-12)
        assert parts["download_s"][k] == pytest.approx(down[k] / (dev.down_bps[c] * f["network"]), rel=1e-12)
        assert parts["upload_s"][k] == pytest.approx(up[k] / (dev.up_bps[c] * f["network"]), rel=1e-12)
    alone = dev.time_parts(np.array([0]), samples[1:], down[1:], up[1:], 4)
    assert alone["compute_s"][0] == parts["compute_s"][1] and alone["upload_s"][0] == parts["upload_s"][1]
    base = dev.time_parts(ids, samples, down, up)
    assert base["compute_s"].tolist() == (samples / dev.compute_sps[ids]).tolist()
