"""The simulated system inside a run: off by default and then invisible; on, it changes who trains and whose upload
the server sees, never what a client computes; its figures reach history and clients.parquet; bad ``system.*``
input and malformed traces are refused in one line before any work."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch

from fedray.cli import main
from fedray.data import build_federated_data
from fedray.record.run_dir import CLIENT_HISTORY_FILE
from fedray.runtime.local import LocalRuntime
from fedray.simulation import run_experiment
from fedray.system.rounds import fresh_round
from tests.conftest import tiny_config

SIM_KEYS = {"sim/round_s", "sim/clock_s", "sim/available", "sim/selected", "sim/stragglers", "sim/dropouts",
            "sim/server_s", "sim/idle_s"}


def _learning(history):
    """Every figure but wall times and the simulated system's."""
    return [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()
             if not k.startswith(("time/", "sim/"))} for row in history]


def test_a_system_without_constraints_changes_no_learning_figure_and_none_adds_no_key():
    """``system.devices=none`` (the default) adds nothing to a run; uniform devices, every client online, no
    over-commitment and no deadline select the same clients and aggregate all of them: only sim/* is added, and each
    round's simulated time is the slowest client's (all equal here: 2 latencies, the bytes, the samples)."""
    cfg = tiny_config(federation__rounds=2)
    data = build_federated_data(cfg.data, cfg.seed)
    plain = run_experiment(cfg, progress=False, data=data)
    timed = run_experiment(tiny_config(federation__rounds=2, system__devices="uniform"), progress=False, data=data)
    assert not any(k.startswith("sim/") for row in plain.history for k in row)
    assert _learning(timed.history) == _learning(plain.history)
    assert all(SIM_KEYS <= set(row) for row in timed.history)
    first = timed.history[0]
    assert first["sim/dropouts"] == first["sim/stragglers"] == 0 and first["sim/selected"] == 3
    assert timed.history[1]["sim/clock_s"] == pytest.approx(first["sim/round_s"] + timed.history[1]["sim/round_s"])


def test_the_server_sees_exactly_the_uploads_that_arrive():
    """A round whose system admits two of four clients leaves the server the state that training those two alone
    would, and only they keep their new client state."""
    cfg = tiny_config(algorithm__name="scaffold", federation__clients_per_round=4, runtime__vectorize=False)
    data = build_federated_data(cfg.data, cfg.seed)
    admitted = LocalRuntime(cfg, data)
    seen = {}

    def admit(ids, infos, down):
        seen.update(ids=ids, samples=[i["work_samples"] for i in infos], down=down)
        return [ids[1], ids[3]]

    step, down = fresh_round(admitted, 1, [0, 1, 2, 3], admit)
    assert seen["ids"] == [0, 1, 2, 3] and seen["down"] == down and min(down) > 0 and len(set(down)) == 1
    assert all(s > 0 for s in seen["samples"])
    assert [i["client"] for i in step.infos] == [1, 3]
    alone = LocalRuntime(cfg, data)
    alone.run_round(1, [1, 3])
    want, got = alone.global_weights(), admitted.global_weights()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert set(admitted.client_states) == {1, 3}
    nobody = LocalRuntime(cfg, data)
    before = {k: v.clone() for k, v in nobody.global_weights().items()}
    assert fresh_round(nobody, 1, [0, 1], lambda ids, infos, down: [])[0].metrics == {}
    assert all(torch.equal(before[k], v) for k, v in nobody.global_weights().items()) and not nobody.client_states


def test_a_constrained_run_records_its_system_per_round_and_per_client(tmp_path):
    cfg = tiny_config(federation__rounds=3, federation__clients_per_round=3, data__num_clients=8,
                      system__devices="heterogeneous", system__availability="markov", system__mean_online_s=3000,
                      system__mean_offline_s=300, system__overcommit=1.5, tracking__enabled=False)
    result = run_experiment(cfg, tmp_path / "run", progress=False)
    rows = result.history
    assert all(row["sim/selected"] <= math.ceil(3 * 1.5) and row["sim/selected"] <= row["sim/available"] for row in rows)
    assert sum(row["sim/stragglers"] for row in rows) > 0
    assert [row["sim/clock_s"] for row in rows] == pytest.approx(
        [sum(r["sim/round_s"] for r in rows[: i + 1]) for i in range(3)])
    clients = pq.read_table(tmp_path / "run" / CLIENT_HISTORY_FILE).to_pydict()
    last = [i for i, r in enumerate(clients["round"]) if r == 3]
    assert sum(clients["sim_rounds"][i] for i in last) <= 3 * 3
    assert all(clients["sim_busy_s"][i] >= 0 for i in last) and max(clients["sim_busy_s"][i] for i in last) > 0


DEVICES = "client,compute_sps,up_mbps,down_mbps,latency_ms\n"
ONLINE = "client,start_s,end_s\n"
GOOD_DEVICES = DEVICES + "".join(f"{c},10,1,1,5\n" for c in range(6))
BAD = [
    # (system overrides, files to write {name: text}, key, a fragment of the message)
    (["system.devices=phones"], {}, "system.devices", "'none', 'uniform', 'heterogeneous', 'trace' or 'fedscale'"),
    (["system.devices=uniform", "system.compute_sps=0"], {}, "system.compute_sps", "greater than 0"),
    (["system.devices=uniform", "system.overcommit=0.5"], {}, "system.overcommit", "greater than or equal to 1"),
    (["system.devices=uniform", "system.deadline_s=-1"], {}, "system.deadline_s", "greater than 0"),
    (["system.overcommit=1.3"], {}, "system.overcommit", "set system.devices to uniform"),
    (["system.speed_sigma=0.5"], {}, "system.speed_sigma", "needs a simulated clock"),
    (["system.availability=markov"], {}, "system.availability", "needs a simulated clock"),
    (["system.devices=trace"], {}, "system.trace", "give system.trace=PATH"),
    (["system.devices=uniform", "system.trace=d.csv"], {}, "system.trace", "only read with system.devices=trace"),
    (["system.devices=uniform", "system.availability=trace"], {}, "system.availability_trace", "give "),
    (["system.devices=trace", "system.trace=nope.csv"], {}, "system.trace", "is not a file"),
    (["system.devices=trace", "system.trace=d.csv"], {"d.csv": GOOD_DEVICES.replace("latency_ms", "rtt_ms")},
     "system.trace", "unknown column 'rtt_ms'"),
    (["system.devices=trace", "system.trace=d.csv"], {"d.csv": DEVICES + "0,10,1,1,5\n1,10,1,1\n"}, "system.trace",
     "row 2 has 4 cells, the header 5"),
    (["system.devices=trace", "system.trace=d.csv"], {"d.csv": GOOD_DEVICES.replace("2,10,1,1,5", "2,10,,1,5")},
     "system.trace", "row 3, column up_mbps: empty; give a number"),
    (["system.devices=trace", "system.trace=d.csv"], {"d.csv": GOOD_DEVICES.replace("3,10,1,1,5", "3,0,1,1,5")},
     "system.trace", "row 4, column compute_sps: 0; must be > 0"),
    (["system.devices=trace", "system.trace=d.csv"], {"d.csv": GOOD_DEVICES.replace("2,10,1,1,5", "2,10,-1,1,5")},
     "system.trace", "row 3, column up_mbps: -1; must be > 0"),
    (["system.devices=trace", "system.trace=d.csv"], {"d.csv": GOOD_DEVICES.replace("5,10,1,1,5\n", "")},
     "system.trace", "client 5 has no row"),
    (["system.devices=trace", "system.trace=d.csv"], {"d.csv": GOOD_DEVICES.replace("5,10", "4,10")},
     "system.trace", "row 6: client 4 is listed again"),
    (["system.devices=trace", "system.trace=d.csv"], {"d.csv": GOOD_DEVICES.replace("5,10", "9,10")},
     "system.trace", "row 6, column client: 9 is not a client id; allowed: 0..5"),
    (["system.devices=trace", "system.trace=d.csv"], {"d.csv": GOOD_DEVICES.replace("1,10,1,1,5", "1,fast,1,1,5")},
     "system.trace", "row 2, column compute_sps: 'fast' is not a number"),
    (["system.devices=uniform", "system.availability=trace", "system.availability_trace=a.csv"],
     {"a.csv": ONLINE + "0,0,10\n1,5,3\n"}, "system.availability_trace", "row 2, column end_s: 3 is not after"),
    (["system.devices=uniform", "system.availability=trace", "system.availability_trace=a.csv"],
     {"a.csv": ONLINE + "0,0,10\n1,0,5\n0,8,20\n"}, "system.availability_trace", "row 3, column start_s"),
]


@pytest.mark.parametrize("system, files, key, fragment", BAD)
def test_bad_system_input_is_refused_in_one_line_before_any_work(system, files, key, fragment, tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = ["run", "synthetic", "data.num_clients=6", "federation.clients_per_round=3", "federation.rounds=1",
            "federation.local_steps=1", "data.synthetic_train_samples=600", *system, "--output-dir", "out",
            "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {key}"), err[0]
    assert fragment in err[0], err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_deadline_no_client_meets_stops_in_one_line_naming_the_key(mode, tmp_path, monkeypatch, capsys):
    """Synchronous rounds stop after DRY_ROUNDS rounds without an arrival, FedBuff after its dropouts in a row; both
    name system.deadline_s, and neither suggests a --resume that would meet the same deadline."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    modes = ["federation.mode=async", "federation.concurrency=1"] if mode == "async" else []
    argv = ["run", "synthetic", "data.num_clients=4", "federation.clients_per_round=2", "federation.rounds=8",
            "federation.local_steps=1", "data.synthetic_train_samples=400", "system.devices=uniform",
            "system.deadline_s=0.001", *modes, "tracking.enabled=false", "--output-dir", "out", "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "raise system.deadline_s" in err[0] and "--resume" not in err[0], err
    assert "finished after system.deadline_s=0.001 s" in err[0] and "online" not in err[0], err[0]


def test_touching_intervals_are_one_interval(tmp_path):
    """[0, 10) then [10, 5000) keeps the client online at 10 s: the same as [0, 5000); a gap keeps two."""
    from fedray.system.availability import TraceAvailability
    from fedray.system.traces import read_availability_trace

    (tmp_path / "a.csv").write_text(ONLINE + "0,10,5000\n1,0,20\n0,0,10\n1,30,40\n0,5000,6000\n")
    client, start, end = read_availability_trace("system.availability_trace", str(tmp_path / "a.csv"), 2)
    assert (client.tolist(), start.tolist(), end.tolist()) == ([0, 1, 1], [0, 0, 30], [6000, 20, 40])
    online, until = TraceAvailability(2, client, start, end).at(10.0)
    assert online.tolist() == [True, True] and until[0] == 6000


def test_a_parquet_trace_reads_as_its_csv(tmp_path):
    import pyarrow as pa

    from fedray.system.traces import read_device_trace

    (tmp_path / "d.csv").write_text(GOOD_DEVICES.replace("4,10,1,1,5", "4,30,2,8,40"))
    csv = read_device_trace("system.trace", str(tmp_path / "d.csv"), 6)
    pq.write_table(pa.table({"client": [5, 4, 3, 2, 1, 0], "compute_sps": [10.0, 30, 10, 10, 10, 10],
                             "up_mbps": [1.0, 2, 1, 1, 1, 1], "down_mbps": [1.0, 8, 1, 1, 1, 1],
                             "latency_ms": [5.0, 40, 5, 5, 5, 5]}), tmp_path / "d.parquet")
    parquet = read_device_trace("system.trace", str(tmp_path / "d.parquet"), 6)
    assert all((csv[k] == parquet[k]).all() for k in csv)
    assert csv["compute_sps"].tolist() == [10, 10, 10, 10, 30, 10]


def test_mlflow_gets_the_sim_figures_and_the_traces_and_a_changed_trace_is_refused_at_resume(tmp_path, monkeypatch,
                                                                                            capsys):
    """Every round's sim/* figures in MLflow; the trace files' SHA-256 in summary.json, the checkpoint and MLflow's
    inputs; a resume after a trace file changed is refused in one line naming its key."""
    import hashlib
    import json

    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "d.csv").write_text(GOOD_DEVICES)
    (tmp_path / "a.csv").write_text(ONLINE + "".join(f"{c},0,100000\n" for c in range(6)))
    argv = ["run", "synthetic", "data.num_clients=6", "federation.clients_per_round=3", "federation.rounds=2",
            "federation.local_steps=1", "data.synthetic_train_samples=600", "system.devices=trace",
            "system.trace=d.csv", "system.availability=trace", "system.availability_trace=a.csv",
            "--output-dir", "out", "--no-progress"]
    assert main(argv) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    clock = client.get_metric_history(run.info.run_id, "sim/clock_s")
    assert sorted(m.step for m in clock) == [1, 2] and clock[-1].value > 0
    assert {"sim/round_s", "sim/dropouts", "sim/available", "sim/idle_s"} <= set(run.data.metrics)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["sim/clock_s"] == pytest.approx(max(m.value for m in clock))
    digest = {k: hashlib.sha256((tmp_path / f).read_bytes()).hexdigest() for k, f in
              (("system.trace", "d.csv"), ("system.availability_trace", "a.csv"))}
    assert {k: v["sha256"] for k, v in summary["traces"].items()} == digest
    inputs = {d.dataset.name: d for d in client.get_run(run.info.run_id).inputs.dataset_inputs}
    assert json.loads(inputs["system.trace"].dataset.source)["sha256"] == digest["system.trace"]
    assert [t.value for t in inputs["system.trace"].tags] == ["system"]
    capsys.readouterr()
    (tmp_path / "a.csv").write_text(ONLINE + "".join(f"{c},0,50000\n" for c in range(6)))
    assert main(["run", "--resume", "out", "federation.rounds=3", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: system.availability_trace") and "changed since" in err[0], err
    now = hashlib.sha256((tmp_path / "a.csv").read_bytes()).hexdigest()
    assert err[0].endswith(f"changed since the checkpoint was written (sha256 {digest['system.availability_trace'][:12]}"
                           f"... then, {now[:12]}... now): the resumed rounds would run on other devices or "
                           "availability; restore the file or start a new run"), err
    assert client.get_run(run.info.run_id).info.status == "FINISHED"  # the refused resume left it as it was


def test_the_trace_examples_of_docs_system_md_read(tmp_path):
    import re
    from pathlib import Path

    from fedray.system.traces import read_availability_trace, read_device_trace

    devices, online = re.findall(r"```csv\n(.*?)```", (Path(__file__).parents[2] / "docs" / "system.md").read_text(),
                                 re.S)
    (tmp_path / "d.csv").write_text(devices)
    (tmp_path / "a.csv").write_text(online)
    assert read_device_trace("system.trace", str(tmp_path / "d.csv"), 4)["compute_sps"].tolist() == [17, 56, 6, 17]
    assert read_availability_trace("system.availability_trace", str(tmp_path / "a.csv"), 3)[0].tolist() == [0, 0, 1, 2]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_event_record_is_kept_through_a_resume(mode, tmp_path):
    """events.parquet: every selected (or dispatched) client of every round, its times and fate; a run of 2 rounds
    extended to 4 writes the 4-round run's record, row for row (speeds varying by round and Oort's selection
    included)."""
    from fedray.record.run_dir import EVENTS_FILE

    kw = dict(system__devices="heterogeneous", system__deadline_s=60.0, system__speed_sigma=0.3,
              federation__mode=mode, runtime__checkpoint_every=1, data__num_clients=6,
              federation__clients_per_round=3, federation__local_steps=2)
    if mode == "sync":  # Oort's selector state resumed too: the same clients are selected after the resume
        kw.update(system__overcommit=1.5, system__selection="oort")
    whole = run_experiment(tiny_config(**kw, federation__rounds=4), tmp_path / "whole", progress=False)
    run_experiment(tiny_config(**kw, federation__rounds=2), tmp_path / "part", progress=False)
    run_experiment(tiny_config(**kw, federation__rounds=4), tmp_path / "part", progress=False,
                   resume_from=tmp_path / "part")
    events = pq.read_table(tmp_path / "whole" / EVENTS_FILE)
    assert pq.read_table(tmp_path / "part" / EVENTS_FILE).equals(events)
    rows = events.to_pandas()
    per_round = rows.groupby(["round", "outcome"]).size().unstack(fill_value=0)
    dropouts = per_round.filter(like="dropout").sum(axis=1)
    assert dropouts.tolist() == [r["sim/dropouts"] for r in whole.history]
    assert (per_round["aggregated"] > 0).all() and set(rows["outcome"]) <= {"aggregated", "straggler",
                                                                          "dropout_offline", "dropout_deadline"}
    from fedray.report.events import event_rows

    table = event_rows(tmp_path / "whole" / EVENTS_FILE)  # what fedray report --events prints
    assert [(r["round"], r["aggregated"], r["dropout_offline"] + r["dropout_deadline"]) for r in table] == [
        (r, per_round.loc[r, "aggregated"], dropouts.loc[r]) for r in range(1, 5)]
    assert main(["report", "--events", str(tmp_path / "whole"), "--target", "0.5"]) == 2  # one run's: no --target
    if mode == "sync":  # every selected client settles in its round (asynchronous ones in the step they finish in)
        assert rows.groupby("round").size().tolist() == [r["sim/selected"] for r in whole.history]
        assert per_round.get("straggler", 0 * dropouts).tolist() == [r["sim/stragglers"] for r in whole.history]
    assert (rows["t_s"] - rows[["latency_s", "download_s", "compute_s", "upload_s"]].sum(axis=1)).abs().max() < 1e-9


@pytest.mark.ray
def test_on_ray_the_system_gives_the_in_process_rounds_and_event_record(ray_local, tmp_path):
    """FedScale's device and behaviour traces, Oort's selection (utilities computed in the workers), speeds varying
    by round, a deadline and over-commitment on Ray (two workers): every figure and every row of events.parquet is
    the in-process run's."""
    from fedray.record.run_dir import EVENTS_FILE
    from tests.system.test_fedscale_traces import PROFILES, _pickle

    behaviour = {"a": {"duration": 0, "active": [0], "inactive": [500], "finish_time": 600, "model": "m"},
                 "b": {"duration": 0, "active": [0, 12], "inactive": [6, 20], "finish_time": 20, "model": "m"}}
    kw = dict(system__devices="fedscale", system__trace=_pickle(tmp_path, PROFILES, "devices.pkl"),
              system__availability="fedscale", system__availability_trace=_pickle(tmp_path, behaviour, "online.pkl"),
              system__deadline_s=60.0, system__speed_sigma=0.3,
              system__overcommit=1.5, system__selection="oort", data__num_clients=8, federation__rounds=3,
              federation__clients_per_round=3, federation__local_steps=2, tracking__enabled=False)
    local = run_experiment(tiny_config(**kw), tmp_path / "local", progress=False)
    ray = run_experiment(tiny_config(**kw, runtime__backend="ray", runtime__num_workers=2), tmp_path / "ray",
                         progress=False)

    def figures(history):  # Ray counts the clients it lost (health/dropped_clients, 0 here); in process none are
        return [{k: v for k, v in row.items() if not k.startswith("time/") and k != "health/dropped_clients"}
                for row in history]

    assert figures(ray.history) == figures(local.history)
    assert pq.read_table(tmp_path / "ray" / EVENTS_FILE).equals(pq.read_table(tmp_path / "local" / EVENTS_FILE))
    assert sum(r["sim/oort_explored"] for r in local.history) < 3 * 5  # Oort exploited some clients
