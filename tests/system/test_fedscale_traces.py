"""FedScale's trace pickles read into fedray's system model, and availability traces that repeat: hand-computed
devices and online answers, FedScale's own time formula, each malformed input refused in one line, a pickle that
asks for a foreign class refused unbuilt. Tiny fabricated pickles; no Ray, no training."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from fedray.errors import ConfigError
from fedray.system import SystemConfig, check_traces
from fedray.system.availability import CyclicTrace
from fedray.system.clock import SystemClock, build_availability
from fedray.system.devices import Devices
from fedray.system.fedscale import read_fedscale_behaviour

PROFILES = {1: {"computation": 10.0, "communication": 1000.0},  # keys 1..3, so mapped id 0 is missing: the default
            2: {"computation": np.float64(50.0), "communication": np.int64(250)},
            3: {"computation": 2.0, "communication": 8000.0}}

#: entry "x": online [0, 10] and [50, 100] of a 100 s cycle (the second runs on into the next cycle's first);
#: entry "y": online [20, 30] of a 40 s cycle. Client c gets keys[(c + 1) % 2]: clients 0, 2: "y"; 1, 3: "x".
BEHAVIOUR = {"x": {"duration": 60, "inactive": [10, 100], "finish_time": 100, "active": [0, 50], "model": "m"},
             "y": {"duration": 10, "inactive": [30], "finish_time": 40, "active": [20], "model": "m"}}


def _pickle(tmp_path, value, name="t.pkl") -> str:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(value))
    return str(path)


def _fedscale(tmp_path, devices=PROFILES, behaviour=BEHAVIOUR, **keys) -> SystemConfig:
    return SystemConfig(devices="fedscale", trace=_pickle(tmp_path, devices, "d.pkl"), availability="fedscale",
                        availability_trace=_pickle(tmp_path, behaviour, "b.pkl"), **keys)


def test_device_profiles_map_as_fedscale_does_and_a_missing_mapped_id_gets_its_default(tmp_path):
    """fedray client c is FedScale's c + 1 and gets profile (c + 1) % 3: clients 0, 1 -> 1, 2; client 2 -> 0, not
    a key, so FedScale's default {computation 1, communication 1}; client 3 -> 1 again."""
    dev = Devices.build(_fedscale(tmp_path), num_clients=4, seed=0)
    computation = np.array([10.0, 50.0, 1.0, 10.0])
    communication = np.array([1000.0, 250.0, 1.0, 1000.0])
    assert dev.compute_sps == pytest.approx(1000 / (3 * computation), rel=1e-12)  # 33.3, 6.67, 333.3, 33.3 /s
    assert dev.up_bps == pytest.approx(communication * 1024 / 8, rel=1e-12)  # kbit/s of 1024 bits, in bytes/s
    assert (dev.down_bps == dev.up_bps).all() and (dev.latency_s == 0).all()


def test_a_client_time_is_fedscales_formula(tmp_path):
    """samples / compute_sps + bytes down / down + bytes up / up equals FedScale's get_completion_time: 3 x
    batch_size x local_steps x computation / 1000 + (upload_kbit + download_kbit) / communication, kbit = bytes /
    1024 x 8, with samples = batch_size x local_steps."""
    dev = Devices.build(_fedscale(tmp_path), num_clients=4, seed=0)
    ids = np.arange(4)
    batch_size, local_steps = 20, 7
    down, up = np.array([4e5, 4e5, 4e5, 4e5]), np.array([4e5, 1e5, 3e3, 123457.0])
    ours = dev.client_time(ids, np.full(4, batch_size * local_steps, dtype=float), down, up)
    for c in ids:
        profile = PROFILES.get((c + 1) % len(PROFILES), {"computation": 1.0, "communication": 1.0})
        theirs = (3.0 * batch_size * local_steps * float(profile["computation"]) / 1000.0
                  + (up[c] / 1024 * 8 + down[c] / 1024 * 8) / float(profile["communication"]))
        assert ours[c] == pytest.approx(theirs, rel=1e-12, abs=1e-9)


def test_behaviour_trace_reads_to_cyclic_online_answers(tmp_path):
    """Each client's intervals repeat with its entry's finish_time; "x"'s [50, 100] runs on into the next cycle's
    [0, 10], so its online period ends at 110, and 100 is no change; next_online and next_change cross cycles."""
    avail = build_availability(_fedscale(tmp_path), num_clients=4, seed=0)
    assert isinstance(avail, CyclicTrace)
    y, x = [0, 2], [1, 3]

    def online(t):
        mask, until = avail.at(t)
        return mask.tolist(), until

    assert online(5.0)[0] == [False, True, False, True] and online(5.0)[1][x].tolist() == [10, 10]
    assert online(25.0)[0] == [True, False, True, False] and online(25.0)[1][y].tolist() == [30, 30]
    assert online(10.0)[0] == [False] * 4 and avail.next_online(10.0) == 20 and avail.next_change(10.0) == 20
    assert avail.next_change(35.0) == 50  # "x" comes online at 50; "y"'s next start is 60
    assert online(70.0)[1][x].tolist() == [110, 110]  # across the cycle boundary: no end at 100
    assert avail.next_change(95.0) == 100  # "y": 95 % 40 = 15, its next start 100 (= 2 x 40 + 20)
    assert avail.next_change(101.0) == 110 and avail.next_online(115.0) == 140  # "y" at 3 x 40 + 20
    # a later cycle: 1000 + 5 for "x" (10th cycle), 1000 % 40 = 0 for "y"
    assert online(1005.0)[0] == [False, True, False, True] and online(1005.0)[1][x].tolist() == [1010, 1010]
    assert avail.next_online(1011.0) == 1020 and online(1020.0)[0] == [True, False, True, False]
    assert not math.isinf(avail.next_change(1e9))  # a cyclic trace never ends


def test_a_repeating_csv_trace(tmp_path):
    """system.availability_cycle_s repeats a fedray trace; a client online for the whole cycle never goes offline,
    and one online [80, 100) then [0, 20) stays online across the boundary."""
    (tmp_path / "a.csv").write_text("client,start_s,end_s\n0,0,20\n0,80,100\n1,30,40\n2,0,100\n")
    cfg = SystemConfig(devices="uniform", availability="trace", availability_trace=str(tmp_path / "a.csv"),
                       availability_cycle_s=100)
    check_traces(cfg, 3)
    avail = build_availability(cfg, 3, seed=0)
    mask, until = avail.at(90.0)
    assert mask.tolist() == [True, False, True] and until[0] == 120 and until[2] == math.inf
    mask, until = avail.at(735.0)
    assert mask.tolist() == [False, True, True] and until[1] == 740
    assert avail.next_change(741.0) == 780 and avail.next_change(790.0) == 820
    # without the key the same file ends for good: nobody but client 2 is online after 100 s
    plain = build_availability(cfg.model_copy(update={"availability_cycle_s": None}), 3, seed=0)
    assert plain.at(735.0)[0].tolist() == [False, False, False] and plain.next_change(150.0) == math.inf


def test_a_time_the_trace_returned_reads_back_at_its_edge_whatever_the_rounding():
    """A period that is not a binary fraction: next_online's answer, many cycles on, reads back as online."""
    avail = CyclicTrace(1, np.array([0]), np.array([0.3]), np.array([0.5]), np.array([0.7]))
    t = 1e5 * 0.7 + 0.55
    start = avail.next_online(t)
    assert start > t and avail.at(start)[0].tolist() == [True]
    end = avail.next_change(start)
    assert end > start and avail.at(end)[0].tolist() == [False]


def test_a_clock_on_fedscales_traces_selects_only_online_clients(tmp_path):
    clock = SystemClock(_fedscale(tmp_path), num_clients=4, per_round=2, seed=0)
    assert sorted(clock.select(1)) == [1, 3]  # at 0 s "x" is online, "y" is not
    clock.clock = 12.0  # nobody online: the round waits for "y" at 20 s
    assert sorted(clock.select(2)) == [0, 2] and clock.clock == 20


PROFILE_SHAPE = "{profile id: {'computation': ms per sample, 'communication': kbit/s}}"
BAD_DEVICES = [  # each message whole, after the file's path
    ([1, 2], f" holds a list, not FedScale's device profiles (a dict {PROFILE_SHAPE})"),
    ({}, f" holds an empty dict, not FedScale's device profiles (a dict {PROFILE_SHAPE})"),
    ({"1": {"computation": 1.0, "communication": 1.0}}, ": profile key '1' is not an integer; FedScale maps a client "
     "id to the profile of that integer key"),
    ({1: {"computation": 1.0}}, ": profile 1: no field 'communication'; a profile is {'computation': ms per sample, "
     "'communication': kbit/s}"),
    ({1: {"computation": 0.0, "communication": 1.0}}, ": profile 1, field computation: 0.0; must be a number > 0"),
    ({1: {"computation": 1.0, "communication": "fast"}}, ": profile 1, field communication: 'fast'; must be a number "
     "> 0"),
    ({1: [1.0, 2.0]}, ": profile 1: a list, not a dict with fields 'computation' and 'communication'"),
]


@pytest.mark.parametrize("profiles, message", BAD_DEVICES)
def test_a_malformed_device_pickle_is_refused_in_one_line(tmp_path, profiles, message):
    with pytest.raises(ConfigError) as e:
        check_traces(SystemConfig(devices="fedscale", trace=_pickle(tmp_path, profiles)), 3)
    assert e.value.key == "system.trace" and e.value.message.split("t.pkl", 1)[1] == message, e.value


def _entry(**change):
    return {"x": {**BEHAVIOUR["x"], **change}}


BAD_BEHAVIOUR = [  # each message whole, after the file's path
    ("not a dict", " holds a str, not FedScale's client behaviour trace (a dict {key: {'active': [s], 'inactive': [s], "
     "'finish_time': s, ...}})"),
    ({"x": [0, 10]}, ": entry 'x': a list, not a dict with fields active, inactive, finish_time"),
    ({"x": {"active": [0], "inactive": [10]}}, ": entry 'x': no field 'finish_time'; an entry has fields active, "
     "inactive, finish_time (and FedScale's duration and model, unused)"),
    (_entry(active=[0]), ": entry 'x', field inactive: 2 values for 1 in active; interval j is [active[j], "
     "inactive[j]]"),
    (_entry(active=[0, "a"]), ": entry 'x', field active: 'a' is not a number (seconds)"),
    (_entry(inactive=5), ": entry 'x', field inactive: must be a list of numbers (seconds), not 5"),
    (_entry(active=[0, 60], inactive=[10, 55]), ": entry 'x', field inactive: interval 1 [60, 55] ends before it "
     "starts"),
    (_entry(active=[0, 5], inactive=[10, 20]), ": entry 'x', field active: interval 1 [5, 20] overlaps interval 0 "
     "[0, 10]"),
    (_entry(finish_time=0), ": entry 'x', field finish_time: 0; must be a number > 0 (the period, s, after which the "
     "entry's intervals repeat)"),
    (_entry(inactive=[10, 120]), ": entry 'x', field inactive: interval 1 [50, 120] ends past finish_time=100, the "
     "period"),
    (_entry(active=[-5, 50]), ": entry 'x', field active: interval 0 [-5, 10] must lie within [0, finish_time] "
     "(finite, >= 0)"),
    ({"x": {**BEHAVIOUR["x"], "active": [], "inactive": []}}, ": none of the entries data.num_clients=3 clients get "
     "has an online interval: no client would ever be online"),
    ({}, " holds an empty dict, not FedScale's client behaviour trace (a dict {key: {'active': [s], 'inactive': [s], "
     "'finish_time': s, ...}})"),
    (_entry(finish_time="soon"), ": entry 'x', field finish_time: 'soon'; must be a number > 0 (the period, s, after "
     "which the entry's intervals repeat)"),
    (_entry(inactive=[10, "b"]), ": entry 'x', field inactive: 'b' is not a number (seconds)"),
    (_entry(active=[[0, 1]], inactive=[10]), ": entry 'x', field active: [0, 1] is not a number (seconds)"),
    (_entry(inactive=[10, math.inf]), ": entry 'x', field inactive: interval 1 [50, inf] must lie within [0, "
     "finish_time] (finite, >= 0)"),
    # the second entry's intervals: their index counts within the entry, their clash is the entry's own
    ({**BEHAVIOUR, "y": {"active": [30], "inactive": [20], "finish_time": 40}}, ": entry 'y', field inactive: "
     "interval 0 [30, 20] ends before it starts"),
    ({"x": {"active": [0], "inactive": [3], "finish_time": 40}, "y": {"active": [0, 5], "inactive": [10, 20],
                                                                        "finish_time": 40}},
     ": entry 'y', field active: interval 1 [5, 20] overlaps interval 0 [0, 10]"),
    # a value's repr up to 40 characters is shown whole, a longer one cut to 37 and "..."
    (_entry(inactive="a" * 38), f": entry 'x', field inactive: must be a list of numbers (seconds), not '{'a' * 38}'"),
    (_entry(inactive="a" * 39), f": entry 'x', field inactive: must be a list of numbers (seconds), not '{'a' * 36}..."),
]


@pytest.mark.parametrize("trace, message", BAD_BEHAVIOUR)
def test_a_malformed_behaviour_pickle_is_refused_in_one_line(tmp_path, trace, message):
    with pytest.raises(ConfigError) as e:
        check_traces(SystemConfig(devices="uniform", availability="fedscale",
                                  availability_trace=_pickle(tmp_path, trace)), 3)
    assert e.value.key == "system.availability_trace" and e.value.message.split("t.pkl", 1)[1] == message, e.value


def test_touching_intervals_merge_and_a_zero_length_one_is_dropped(tmp_path):
    path = _pickle(tmp_path, _entry(active=[0, 10, 40, 70], inactive=[10, 30, 40, 80]))
    client, start, end, period = read_fedscale_behaviour("system.availability_trace", path, 2)
    assert (client.tolist(), start.tolist(), end.tolist(), period.tolist()) == (
        [0, 0, 1, 1], [0, 70, 0, 70], [30, 80, 30, 80], [100, 100])


def test_each_entry_merges_its_own_touching_intervals_and_client_c_gets_entry_c_plus_1():
    """Entries x, y, z; client c gets keys[(c + 1) % 3]: clients 0..3 -> y, z, x, y. y's [0, 10] and [10, 20]
    touch and merge; x's [0, 0.5] and z's [5, 8] touch no interval of their own entry; x's cycle of 1 s is a cycle."""
    import tempfile
    from pathlib import Path

    trace = {"x": {"active": [0], "inactive": [0.5], "finish_time": 1},
             "y": {"active": [10, 0], "inactive": [20, 10], "finish_time": 40},
             "z": {"active": [5], "inactive": [8], "finish_time": 50}}
    with tempfile.TemporaryDirectory() as d:
        client, start, end, period = read_fedscale_behaviour("system.availability_trace",
                                                             _pickle(Path(d), trace), 4)
    assert (client.tolist(), start.tolist(), end.tolist(), period.tolist()) == (
        [0, 1, 2, 3], [0, 5, 0, 0], [20, 8, 0.5, 20], [40, 50, 1, 40])


def test_a_trace_file_rewritten_is_read_again_whether_its_size_or_its_time_changed(tmp_path):
    """The reader caches a file by path, modification time and size: a rewrite of the same size (floats pickle
    in 8 bytes) with a new time, or of a new size with the old time, is read again."""
    import os

    from fedray.system.fedscale import read_fedscale_devices

    path = _pickle(tmp_path, PROFILES, "d.pkl")
    mtime = os.stat(path).st_mtime_ns

    def sps():
        return read_fedscale_devices("system.trace", path, 1)["compute_sps"].tolist()  # client 0: profile 1

    assert sps() == [pytest.approx(1000 / 30)]
    _pickle(tmp_path, {**PROFILES, 1: {"computation": 20.0, "communication": 1000.0}}, "d.pkl")
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # same size, one second later
    assert sps() == [pytest.approx(1000 / 60)]
    _pickle(tmp_path, {**PROFILES, 1: {"computation": 40.0, "communication": 1000.0, "note": "longer"}}, "d.pkl")
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # a new size, the time read before
    assert sps() == [pytest.approx(1000 / 120)]


@pytest.mark.parametrize("data, detail", [
    (b"", "EOFError: Ran out of input"),
    (b"Fx\n.", "ValueError: could not convert string to float: 'x"),  # an error of two lines: its first
    (None, "MemoryError: no detail"),  # an error without a message
])
def test_a_file_that_is_not_a_pickle_is_refused_naming_the_error(tmp_path, monkeypatch, data, detail):
    from fedray.system import fedscale

    path = tmp_path / "t.pkl"
    path.write_bytes(b"\x80\x05N." if data is None else data)
    if data is None:
        def load(self):
            raise MemoryError()

        monkeypatch.setattr(fedscale._TraceUnpickler, "load", load)
    with pytest.raises(ConfigError) as e:
        check_traces(SystemConfig(devices="fedscale", trace=str(path)), 3)
    assert e.value.key == "system.trace" and e.value.message == f"{path} is not a readable pickle ({detail})"


def test_a_trace_that_is_not_a_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError) as e:
        check_traces(SystemConfig(devices="fedscale", trace=str(tmp_path / "none.pkl")), 3)
    assert e.value.key == "system.trace" and e.value.message == (
        f"{tmp_path / 'none.pkl'} is not a file; give FedScale's pickle (docs/system.md#fedscales-traces)")


@pytest.mark.parametrize("csv, cycle, message", [
    ("0,0,20\n0,80,120\n", 100, "row 2, column end_s: 120 is past the cycle's end (100 s)"),
])
def test_a_repeating_csv_trace_past_its_cycle_is_refused(tmp_path, csv, cycle, message):
    (tmp_path / "a.csv").write_text("client,start_s,end_s\n" + csv)
    cfg = SystemConfig(devices="uniform", availability="trace", availability_trace=str(tmp_path / "a.csv"),
                       availability_cycle_s=cycle)
    with pytest.raises(ConfigError) as e:
        check_traces(cfg, 1)
    assert e.value.key == "system.availability_cycle_s" and message in e.value.message, e.value


@pytest.mark.parametrize("csv, key, message", [
    ("0,0,20\n0,80,120\n", "system.availability_cycle_s", "row 2, column end_s: 120 is past the cycle's end (100 s)"),
    ("0,0,20\n0,10,30\n", "system.availability_trace", "overlaps row 1's [0, 20); merge them"),
])
def test_building_a_repeating_trace_unchecked_refuses_it_naming_the_key(tmp_path, csv, key, message):
    """The clock's own build (no check_traces before it, as online_seconds and a resumed clock build it) reads the
    trace against its cycle and names the key that is wrong."""
    (tmp_path / "a.csv").write_text("client,start_s,end_s\n" + csv)
    cfg = SystemConfig(devices="uniform", availability="trace", availability_trace=str(tmp_path / "a.csv"),
                       availability_cycle_s=100)
    with pytest.raises(ConfigError) as e:
        build_availability(cfg, 1, seed=0)
    assert e.value.key == key and message in e.value.message, e.value


@pytest.mark.parametrize("keys", [
    {"availability": "trace", "availability_trace": "gone.csv"},
    {"availability": "fedscale", "availability_trace": "gone.pkl"},
    {"devices": "trace", "trace": "gone.csv"},
    {"devices": "fedscale", "trace": "gone.pkl"},
], ids=["availability-trace", "availability-fedscale", "devices-trace", "devices-fedscale"])
def test_each_trace_built_unchecked_names_its_own_key_when_its_file_is_gone(tmp_path, keys):
    """The builders read their files themselves (a resumed clock, online_seconds): a file gone since the config was
    checked is refused naming the key that gave it, for every kind of trace."""
    keys = {k: str(tmp_path / v) if k.endswith("trace") else v for k, v in keys.items()}
    cfg = SystemConfig(**{"devices": "uniform", **keys})
    with pytest.raises(ConfigError) as e:
        if "trace" in keys:
            Devices.build(cfg, 2, seed=0)
        else:
            build_availability(cfg, 2, seed=0)
    key = "system.trace" if "trace" in keys else "system.availability_trace"
    assert e.value.key == key and "is not a file" in e.value.message, e.value


CLOCK = "needs a simulated clock; set system.devices to uniform, heterogeneous, trace or fedscale"


@pytest.mark.parametrize("keys, key, message", [
    ({"devices": "fedscale"}, "system.trace", "system.devices=fedscale needs a file; give system.trace=PATH "
     "(FedScale's client_device_capacity pickle, docs/system.md#fedscales-traces)"),
    ({"devices": "trace"}, "system.trace", "system.devices=trace needs a file; give system.trace=PATH (CSV or parquet "
     "with columns client, compute_sps, up_mbps, down_mbps, latency_ms)"),
    ({"devices": "uniform", "trace": "d.csv"}, "system.trace",
     "is only read with system.devices=trace or fedscale (it is uniform)"),
    ({"devices": "uniform", "availability": "fedscale"}, "system.availability_trace", "system.availability=fedscale "
     "needs a file; give system.availability_trace=PATH (FedScale's client_behave_trace pickle, "
     "docs/system.md#fedscales-traces)"),
    ({"devices": "uniform", "availability": "trace"}, "system.availability_trace", "system.availability=trace needs "
     "a file; give system.availability_trace=PATH (CSV or parquet with columns client, start_s, end_s)"),
    ({"devices": "uniform", "availability": "markov", "availability_trace": "a.csv"}, "system.availability_trace",
     "is only read with system.availability=trace or fedscale (it is markov)"),
    ({"devices": "uniform", "oort": {"pacer_step": 10}}, "system.oort.pacer_step",
     "is only read with system.selection=oort (it is uniform)"),
    ({"devices": "uniform", "availability": "markov", "availability_cycle_s": 60.0}, "system.availability_cycle_s",
     "repeats the intervals of system.availability=trace (it is markov); FedScale's traces give each client's period "
     "themselves"),
    ({"availability": "markov"}, "system.availability", CLOCK),
    ({"deadline_s": 5.0}, "system.deadline_s", CLOCK),
    ({"selection": "oort"}, "system.selection", CLOCK),  # the last of the keys a clock needs
], ids=["fedscale-devices", "trace-devices", "unread-trace", "fedscale-availability", "trace-availability",
        "unread-availability-trace", "unread-oort", "cycle", "clock-availability", "clock-deadline", "clock-selection"])
def test_keys_that_disagree_are_refused_in_full(keys, key, message):
    """Each refusal of :meth:`SystemConfig.check`, word for word: the key and what to do about it."""
    with pytest.raises(ConfigError) as e:
        SystemConfig(**keys).check()
    assert (e.value.key, e.value.message) == (key, message)


@pytest.mark.parametrize("keys", [{"devices": "fedscale", "trace": "d.pkl", "availability": "fedscale",
                                   "availability_trace": "a.pkl"},
                                  {"devices": "trace", "trace": "d.csv", "availability": "trace",
                                   "availability_trace": "a.csv", "availability_cycle_s": 60.0},
                                  {"devices": "uniform", "selection": "oort", "oort": {"pacer_step": 10}}],
                         ids=["fedscale", "trace", "oort"])
def test_keys_that_agree_pass_the_check(keys):
    SystemConfig(**keys).check()


def test_a_pickle_asking_for_another_class_is_refused_unbuilt(tmp_path):
    """A pickle whose reduction names os.system would run a shell command under pickle.load: it is refused before
    anything of it is called (the marker file is never written)."""
    import os

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    path = _pickle(tmp_path, {1: {"computation": Exploit(), "communication": 1.0}})
    with pytest.raises(ConfigError) as e:
        check_traces(SystemConfig(devices="fedscale", trace=path), 3)
    assert e.value.key == "system.trace" and e.value.message == (
        f"{path} asks to build a {os.system.__module__}.system, which FedScale's traces never hold; refused unbuilt "
        "(a pickle can run code: only dicts, lists, numbers, strings and numpy values are read)"), e.value
    assert not (tmp_path / "ran").exists()


def test_numpy_values_pickled_by_numpy_1_or_2_read_the_same_without_a_deprecation(tmp_path, monkeypatch):
    """FedScale's pickles were written by numpy 1 (``numpy.core.multiarray``); numpy 2 names ``numpy._core`` and
    keeps ``numpy.core`` as a deprecated alias: both spellings read as today's numpy, never through the alias."""
    import warnings

    profiles = {1: {"computation": np.float64(2.5), "communication": np.float64(40.0)},
                0: {"computation": np.float32(3.0), "communication": 50}}
    text = pickle.dumps(profiles, protocol=0)
    assert b"numpy._core" in text or b"numpy.core" in text
    for spelling in (b"numpy._core", b"numpy.core"):
        path = tmp_path / f"{spelling.decode()}.pkl"
        path.write_bytes(text.replace(b"numpy._core", spelling).replace(b"numpy.core", spelling))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dev = Devices.build(SystemConfig(devices="fedscale", trace=str(path)), num_clients=2, seed=0)
        # client c reads profile (c + 1) mod 2: client 0 profile 1, client 1 profile 0
        got = dev.client_time(np.arange(2), np.array([1000.0, 1000.0]), np.zeros(2), np.zeros(2))
        assert got.tolist() == pytest.approx([3 * 2.5, 3 * 3.0], rel=1e-6)
    # arrays in a protocol-5 pickle are built by numpy.core.numeric._frombuffer, which numpy 2 reads only as
    # numpy._core's (its numpy.core alias warns, unlike the scalars' and older arrays' functions it keeps for pickles)
    from numpy._core import numeric

    trace = {"x": {"active": np.array([0.0, 50.0]), "inactive": np.array([10.0, 100.0]), "finish_time": 100}}
    for spelling in ("numpy._core", "numpy.core"):  # a frame's length counts the name: pickled under each spelling
        path = tmp_path / f"b-{spelling}.pkl"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            monkeypatch.setattr(numeric._frombuffer, "__module__", f"{spelling}.numeric")
            path.write_bytes(text := pickle.dumps(trace, protocol=5))
        assert f"{spelling}.numeric".encode() in text and b"_frombuffer" in text
        monkeypatch.undo()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = read_fedscale_behaviour("system.availability_trace", str(path), 1)
        assert [a.tolist() for a in got] == [[0, 0], [0, 50], [10, 100], [100]]


def test_trace_digests_name_each_trace_a_run_reads_and_see_every_change(tmp_path):
    """The files each kind of trace reads, by their real path (a link resolved) and their SHA-256; a file named but
    not read by its kind is not recorded; a rewritten file gets its new digest whether its size or its time alone
    changed (the digests are cached by both)."""
    import hashlib
    import os

    from fedray.system.traces import trace_digests

    dev, online = tmp_path / "d.csv", tmp_path / "a.csv"
    dev.write_text("devices")
    online.write_text("online")
    (tmp_path / "link.csv").symlink_to(dev)

    def entry(p):
        return {"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}

    assert trace_digests(SystemConfig(devices="uniform", trace=str(dev), availability="markov",
                                      availability_trace=str(online))) == {}
    for kind in ("trace", "fedscale"):
        cfg = SystemConfig(devices=kind, trace=str(tmp_path / "link.csv"), availability=kind,
                           availability_trace=str(online))
        assert trace_digests(cfg) == {"system.trace": entry(dev), "system.availability_trace": entry(online)}
    cfg = SystemConfig(devices="trace", trace=str(dev))
    assert trace_digests(cfg) == {"system.trace": entry(dev)}
    before = dev.stat()
    dev.write_text("DEVICES")  # the same size, a later time
    os.utime(dev, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert trace_digests(cfg) == {"system.trace": entry(dev)}
    before = dev.stat()
    dev.write_text("devices, longer")  # another size, the same time
    os.utime(dev, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert trace_digests(cfg) == {"system.trace": entry(dev)}
