"""Ray Tune sweeps: spec validation, placement groups, MLflow parent/child runs, failures, ASHA, resume."""

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient

from fedray.cli import main
from fedray.errors import ConfigError, ResourceError
from fedray.sweep.spec import (check_repeats, check_trials_fit, load_spec, planned_trials, selects_on_test_data,
                           trial_bundles)

TINY = {"data.num_clients": 6, "data.synthetic_train_samples": 600, "data.synthetic_test_samples": 200,
        "federation.clients_per_round": 3, "federation.rounds": 3, "federation.local_steps": 5}


def write_spec(path, **spec):
    spec.setdefault("base", "synthetic")
    spec["overrides"] = {**TINY, **spec.get("overrides", {})}
    spec.setdefault("storage", str(path.parent / "sweeps"))
    path.write_text(yaml.safe_dump(spec))
    return path


def children(client, experiment):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("fedray.kind") == "sweep"]
    kids = [r for r in runs if r.data.tags.get("fedray.kind") == "trial"]
    return parents, kids


# --- spec validation (no Ray) -----------------------------------------------------------------------

@pytest.mark.parametrize("search, key, fragment", [
    ({"data.alpah": {"grid": [1]}}, "search.data.alpah", "unknown key"),
    ({"data.alpha": {"grid": [1.0, -1]}}, "search.data.alpha", "value -1 is invalid"),
    ({"federation.lr": {"loguniform": [0, 1]}}, "search.federation.lr", "low > 0"),
    ({"federation.lr": {"uniform": [1, 0.1]}}, "search.federation.lr", "low < high"),
    ({"federation.lr": {"grid": [0.1], "choice": [0.2]}}, "search.federation.lr", "exactly one"),
    ({"algorithm.name": {"choice": ["fedavg", "nope"]}}, "search.algorithm.name", "unknown algorithm"),
])
def test_bad_search_spaces_are_refused_naming_the_key(tmp_path, search, key, fragment):
    path = write_spec(tmp_path / "s.yaml", search=search)
    with pytest.raises(ConfigError) as e:
        load_spec(path)
    assert e.value.key == key and fragment in e.value.message


def test_repeats_of_a_grid_only_search_are_refused():
    """Same configs, same seed: repeats would be copies passing for independent trials."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        grid = {"data.alpha": {"grid": [0.5, 1.0]}, "seed": {"grid": [0, 1]}}
        spec = load_spec(write_spec(Path(d) / "g.yaml", search=grid, num_samples=3))
        with pytest.raises(ConfigError, match="identical trials") as e:
            check_repeats(spec)
        assert e.value.key == "num_samples"
        check_repeats(spec, 1)  # --num-samples 1 overrides the spec's 3
        drawn = load_spec(write_spec(Path(d) / "r.yaml", search={**grid, "federation.lr": {"loguniform": [0.01, 0.1]}},
                                     num_samples=3))
        check_repeats(drawn)  # a random dimension: repeats differ
        assert len(planned_trials(drawn)) == 12


def test_spec_defaults_and_bundles(tmp_path):
    spec = load_spec(write_spec(tmp_path / "s.yaml", search={"data.alpha": {"grid": [0.5, 1.0]},
                                                             "federation.lr": {"loguniform": [0.01, 0.1]}}))
    assert spec.name == "s" and spec.metric == "eval/accuracy" and len(planned_trials(spec)) == 2
    local = spec.trial_config({"data.alpha": 0.5, "federation.lr": 0.05})
    assert local.tracking.enabled is False and local.data.alpha == 0.5
    assert trial_bundles(local, 0.25) == [{"CPU": 1.0}]
    gpu = spec.trial_config({"runtime.backend": "ray", "runtime.num_workers": 3, "runtime.num_cpus_per_worker": 0.5,
                             "runtime.num_gpus_per_worker": 0.25, "runtime.server_num_gpus": 0.5})
    assert trial_bundles(gpu, 0.25) == [{"CPU": 0.25}, {"GPU": 0.5}] + [{"CPU": 0.5, "GPU": 0.25}] * 3
    ray1 = spec.trial_config({"runtime.backend": "ray"})
    assert ray1.runtime.num_workers == 1  # a trial's pool is reserved up front


def test_a_sweep_over_steps_on_an_epochs_preset_changes_the_steps(tmp_path):
    """fedkf_fmnist trains local epochs; sweeping local_steps on it used to give identical trials."""
    spec = load_spec(write_spec(tmp_path / "s.yaml", base="fedkf_fmnist",
                                search={"federation.local_steps": {"grid": [5, 10]}}))
    fed = [spec.trial_config(t).federation for t in ({"federation.local_steps": 5}, {"federation.local_steps": 10})]
    assert [(f.local_steps, f.local_epochs) for f in fed] == [(5, None), (10, None)]


def test_missing_spec_and_bad_flags_exit_2(tmp_path, capsys):
    assert main(["tune", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: SPEC:")
    spec = write_spec(tmp_path / "s.yaml", search={"data.alpha": {"grid": [1.0]}})
    assert main(["tune", str(spec), "--max-concurrent", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --max-concurrent")
    (tmp_path / "afile").write_text("x")
    spec = write_spec(tmp_path / "s.yaml", search={"data.alpha": {"grid": [1.0]}}, storage=str(tmp_path / "afile"))
    assert main(["tune", str(spec), "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith("error: storage: ")


def test_shipped_specs_are_valid():
    from pathlib import Path

    specs = sorted(Path(__file__).parents[2].glob("tune_configs/*.yaml"))
    assert len(specs) >= 3
    for path in specs:
        first = path.read_text().splitlines()[0]
        assert first.startswith("#") and "?" in first, f"{path} must open with the question it answers"
        assert re.search(r"\babout \d+(\.\d+)? (s|min|h) on this machine\b", first), \
            f"{path}: its first line must give the expected run time ('about N min on this machine')"
        spec = load_spec(path)
        # A spec that chooses hyperparameters chooses them without the test data; a study says it is one
        assert not selects_on_test_data(spec) or "A study, not a choice of hyperparameters" in path.read_text(), \
            f"{path} selects on {spec.metric}, a figure of the test data"


def test_a_validation_metric_needs_a_validation_set_and_a_test_metric_gets_a_note(tmp_path, capsys):
    search = {"federation.lr": {"grid": [0.1]}}
    with pytest.raises(ConfigError) as e:
        load_spec(write_spec(tmp_path / "v.yaml", metric="val/accuracy", search=search))
    assert e.value.key == "metric" and "data.val_per_class" in e.value.message
    ok = write_spec(tmp_path / "v.yaml", metric="val/accuracy", search=search, overrides={"data.val_per_class": 5})
    assert not selects_on_test_data(load_spec(ok))
    assert main(["tune", str(ok), "--dry-run"]) == 0 and "note:" not in capsys.readouterr().out
    on_test = write_spec(tmp_path / "t.yaml", metric="eval/amp", search=search)
    assert main(["tune", str(on_test), "--dry-run"]) == 0
    assert "note: eval/amp is scored on test data" in capsys.readouterr().out.replace("\n", " ")
    asha = write_spec(tmp_path / "a.yaml", metric="val/accuracy", search={**search, "seed": {"grid": [0, 1]}},
                      overrides={"data.val_per_class": 5}, scheduler={"type": "asha"})
    assert main(["tune", str(asha), "--dry-run"]) == 0
    assert "note: ASHA stops each seed's trial on its own" in capsys.readouterr().out.replace("\n", " ")


def test_dry_run_lists_trials_and_bundles_and_starts_nothing(tmp_path, capsys, monkeypatch):
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()  # the tests' shared Ray (ray_local starts it again for its next user)
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path / "d.yaml", search={"data.alpha": {"grid": [0.5, 1.0]},
                                                   "federation.lr": {"loguniform": [0.01, 0.1]}},
                      overrides={"runtime.backend": "ray", "runtime.num_cpus_per_worker": 0.5}, trial_cpus=0.5,
                      num_samples=2)
    assert main(["tune", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "loguniform [0.01, 0.1]" in line]
    assert len(rows) == 4  # 2 grid values x 2 samples; the random domain is drawn when a trial starts
    assert all("[CPU 0.5] [CPU 0.5]" in row for row in rows)
    assert "nothing was started" in out
    assert not (tmp_path / "sweeps").exists() and not (tmp_path / "mlflow.db").exists()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_trial_the_cluster_can_never_place_is_refused():
    two_nodes = [{"CPU": 2.0}, {"CPU": 2.0, "GPU": 1.0}]
    total = {"CPU": 4.0, "GPU": 1.0}
    check_trials_fit([[{"CPU": 2.0}, {"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0}]], total, two_nodes)  # fits, spread
    for bundles, key, fragment in [([{"CPU": 3.0}, {"CPU": 2.0}], "trial_cpus", "reserves 5 CPU"),
                                   ([{"CPU": 3.0}], "trial_cpus", "fits on no node (the largest has 2)"),
                                   ([{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 0.5}],
                                    "runtime.num_gpus_per_worker", "reserves 1.5 GPU")]:
        with pytest.raises(ResourceError) as e:
            check_trials_fit([[{"CPU": 1.0}], bundles], total, two_nodes)
        assert e.value.key == key and fragment in e.value.message, e.value.message


@pytest.mark.ray
def test_a_sweep_whose_trial_cannot_fit_exits_2_before_writing_anything(tmp_path, capsys, monkeypatch, ray_local):
    """Tune would wait for such a trial without end; fedray says so once Ray is up (the cluster's CPUs)."""
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path / "big.yaml", search={"data.alpha": {"grid": [1.0]}}, trial_cpus=64)
    assert main(["tune", str(spec), "--dry-run"]) == 0
    assert "none fits on this machine" in capsys.readouterr().out
    assert main(["tune", str(spec)]) == 2
    assert capsys.readouterr().err.startswith("error: trial_cpus: a trial reserves 64 CPU")
    assert not (tmp_path / "sweeps").exists()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # the store is opened to check it, no run started
    assert all(not client.search_runs([e.experiment_id]) for e in client.search_experiments())


def test_an_unreachable_address_exits_2_before_the_sweep_starts(tmp_path):
    """In a process of its own: a Ray already up in this one would be used whatever the address."""
    spec = write_spec(tmp_path / "s.yaml", search={"data.alpha": {"grid": [1.0]}})
    proc = subprocess.run([sys.executable, "-m", "fedray.cli", "tune", str(spec), "--address", "127.0.0.1:1"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --address: cannot connect to Ray")
    assert not (tmp_path / "sweeps").exists()


# --- real sweeps --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_trial_sweep(tmp_path_factory):
    """A 4-trial sweep: two trials on the Ray runtime (each its own server and worker actor in its placement group),
    two in process (the trial's own actor trains), over two partitions."""
    import ray

    if ray.is_initialized():
        ray.shutdown()  # the sweep starts its own Ray, as `fedray tune` does
    root = tmp_path_factory.mktemp("sweep")
    spec = write_spec(root / "grid.yaml", search={"data.alpha": {"grid": [0.5, 1.0]},
                                                   "runtime.backend": {"grid": ["local", "ray"]}},
                      overrides={"runtime.num_cpus_per_worker": 0.5,
                                 "tracking.experiment": "grid"}, trial_cpus=0.5)
    # As a user runs it, in a terminal-less process: what it prints is checked below.
    done = subprocess.run([sys.executable, "-m", "fedray.cli", "tune", str(spec), "--name", "g1"], cwd=root,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (root / "stdout.txt").write_text(done.stdout)
    (root / "stderr.txt").write_text(done.stderr)
    return root


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)  # its subprocesses may wait 600 s
def test_sweep_prints_one_line_per_trial_event_and_keeps_ray_logs_in_a_file(four_trial_sweep):
    root = four_trial_sweep
    out, err = (root / "stdout.txt").read_text(), (root / "stderr.txt").read_text()
    ray_log = root / "sweeps" / "g1" / "ray.log"
    for noise in ("== Status ==", "Logical resource usage", "Result logdir", "core_worker", "Checkpoint successfully",
                  "(_trial pid="):
        assert noise not in out + err, noise
    assert err.strip() == ""
    lines = out.splitlines()
    trial_ids = {line[1:line.index("]")] for line in lines if re.match(r"\[\w+_\d+\] ", line)}
    assert len(trial_ids) == 4
    for tid in trial_ids:
        mine = [line for line in lines if line.startswith(f"[{tid}] ")]
        assert mine[0].startswith(f"[{tid}] started") and mine[-1].startswith(f"[{tid}] finished  round 3/3")
        assert [line.split()[2] for line in mine if " round " in line and "finished" not in line] == \
            ["1/3", "2/3", "3/3"]  # every evaluation, with the metric and the best so far
        assert all("eval/accuracy" in line and "best so far" in line for line in mine[1:-1])
    assert f"Ray's and Tune's logs: {ray_log}" in out and "Checkpoint successfully created" in ray_log.read_text()
    assert re.search(r"MLflow: mlflow ui --backend-store-uri sqlite:///\S+ --port 5000, then open "
                     r"http://127.0.0.1:5000/#/experiments/\d+/runs/[0-9a-f]{32}\?workflowType=machine_learning", out)
    assert out.count("MLflow:") == 1 and "best trial of g1" in out


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)  # its subprocesses may wait 600 s
def test_sweep_records_one_parent_and_four_finished_children(four_trial_sweep):
    root = four_trial_sweep
    sweep = root / "sweeps" / "g1"  # the copy of Tune's tuner state that a resume puts back if a kill cut it short
    assert (sweep / "tuner.pkl.fedray").read_bytes() == (sweep / "tuner.pkl").read_bytes()
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    parents, kids = children(client, "grid")
    assert len(parents) == 1 and len(kids) == 4
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.params["search.data.alpha"] == "grid [0.5, 1.0]"
    # The UI opens the experiment on its runs table, not MLflow 3's GenAI view.
    assert client.get_experiment_by_name("grid").tags["mlflow.experimentKind"] == "custom_model_development"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"spec.yaml", "best.json", "sweep.png"}
    best_params = {k: v for k, v in parent.data.params.items() if k.startswith("best.")}
    # the driver's machine over the sweep, on the parent (MLflow's system metrics)
    assert "system/cpu_utilization_percentage" in parent.data.metrics
    seen, digests = set(), {}
    for kid in kids:
        assert kid.info.status == "FINISHED"
        assert kid.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert [m.step for m in client.get_metric_history(kid.info.run_id, "eval/accuracy")] == [1, 2, 3]
        assert {a.path for a in client.list_artifacts(kid.info.run_id)} >= {
            "config.yaml", "summary.json", "history.parquet", "curves.png", "partition.png", "model.pt"}
        seen.add((kid.data.params["data.alpha"], kid.data.params["runtime.backend"]))
        if kid.data.params["runtime.backend"] == "ray":
            assert kid.data.params["runtime.num_workers"] == "1"
        # named by what it ran; the command as its Source; its data as input; its final model logged
        alpha, name = kid.data.params["data.alpha"], kid.data.params["algorithm.name"]
        backend = kid.data.params["runtime.backend"]  # a searched key the name does not already say is added
        assert kid.info.run_name == f"{name} synthetic alpha={float(alpha):g} seed=0 backend={backend}"
        assert kid.data.tags["mlflow.source.name"] == f"fedray tune {root / 'grid.yaml'} --name g1"
        (data,) = kid.inputs.dataset_inputs
        digests.setdefault(alpha, set()).add(data.dataset.digest)
        assert [m.step for m in kid.outputs.model_outputs] == [3]
    assert seen == {("0.5", "local"), ("0.5", "ray"), ("1.0", "local"), ("1.0", "ray")}
    assert [len(d) for d in digests.values()] == [1, 1] and digests["0.5"] != digests["1.0"]  # split, not runtime
    best = json.loads((root / "sweeps" / "g1" / "best.json").read_text())
    assert best["trials"] == 4 and best["errored"] == 0
    # each trial judged by its metric over its last 5 evaluated rounds (all 3 here)
    accs = [np.mean([m.value for m in client.get_metric_history(k.info.run_id, "eval/accuracy")]) for k in kids]
    assert best["metric_value"] == pytest.approx(max(accs)) and best["metric_rounds"].startswith("mean of the last 5")
    assert best_params == {f"best.{k}": str(v) for k, v in best["config"].items()}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)  # its subprocesses may wait 600 s
def test_mlflow_server_serves_the_sweep_over_rest(four_trial_sweep):
    """`mlflow server` on 127.0.0.1 against the sweep's store finds its runs; then it and its workers stop."""
    root = four_trial_sweep
    port = _free_port()
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--host", "127.0.0.1", "--port",
         str(port), "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}/api/2.0/mlflow"
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"{base}/experiments/get-by-name?experiment_name=grid", timeout=2) as r:
                    exp = json.load(r)["experiment"]
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not answer within 60 s")
        req = urllib.request.Request(f"{base}/runs/search", method="POST",
                                     data=json.dumps({"experiment_ids": [exp["experiment_id"]]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            runs = json.load(r)["runs"]
        kinds = sorted(next(t["value"] for t in run["data"]["tags"] if t["key"] == "fedray.kind") for run in runs)
        assert kinds == ["sweep", "trial", "trial", "trial", "trial"]
        assert all(run["info"]["status"] == "FINISHED" for run in runs)
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the workers it forked
        server.wait(timeout=30)
    deadline = time.monotonic() + 30
    while (leftovers := subprocess.run(["pgrep", "-f", f"--port {port}|127.0.0.1:{port}"], capture_output=True,
                                       text=True).stdout.strip()) and time.monotonic() < deadline:
        time.sleep(0.1)  # the forked workers exit on their own time after the TERM
    assert leftovers == "", "mlflow server processes survived"


@pytest.mark.ray
@pytest.mark.slow
def test_failing_trial_does_not_stop_the_sweep_and_asha_ends_children(tmp_path, monkeypatch, capsys, ray_local):
    """data.min_samples=100000 cannot be partitioned: that trial raises; the others finish. ASHA may stop
    the weak learning-rate trial early; every child run ends (none left RUNNING). (On the tests' shared Ray, which
    the sweep leaves up.)"""
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path / "fail.yaml",
                      search={"federation.lr": {"grid": [0.1, 0.000001]}, "data.min_samples": {"grid": [10, 100000]}},
                      overrides={"federation.rounds": 4, "tracking.experiment": "fail"}, trial_cpus=1,
                      max_concurrent=1, scheduler={"type": "asha", "grace_period": 1, "reduction_factor": 2})
    assert main(["tune", str(spec), "--name", "f1"]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parents, kids = children(client, "fail")
    assert [p.info.status for p in parents] == ["FINISHED"]
    status = {(k.data.params["federation.lr"], k.data.params["data.min_samples"]): k.info.status for k in kids}
    assert status[("0.1", "100000")] == "FAILED" and status[("1e-06", "100000")] == "FAILED"
    assert status[("0.1", "10")] == "FINISHED" and status[("1e-06", "10")] == "FINISHED"
    for kid in kids:
        if kid.info.status == "FINISHED":
            done = int(kid.data.tags["fedray.rounds_done"])
            assert kid.data.tags["fedray.stopped_early"] == str(done < 4).lower()
    best = json.loads((tmp_path / "sweeps" / "f1" / "best.json").read_text())
    assert best["errored"] == 2 and best["config"]["federation.lr"] == 0.1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if "] failed " in line]
    assert len(failed) == 2 and all("min_samples" in line and "traceback:" in line for line in failed)
    early = sum(k.info.status == "FINISHED" and k.data.tags["fedray.stopped_early"] == "true" for k in kids)
    assert out.count("stopped by ASHA at round") == early


def test_metric_check_knows_which_results_must_hold_the_metric(tmp_path):
    from types import SimpleNamespace

    from fedray.sweep.report import MetricCheck

    trial = SimpleNamespace(trial_id="t0", config={"federation.lr": 0.1})  # TINY: 3 rounds
    evaluated = {"round": 1, "eval/accuracy": 0.5, "eval/amp": 0.4, "train/loss": 1.0}
    plain = {"round": 1, "train/loss": 1.0}

    def check(metric, result):
        spec = load_spec(write_spec(tmp_path / "s.yaml", metric=metric, search={"federation.lr": {"grid": [0.1]}},
                                    overrides={"federation.rounds": 3}))
        MetricCheck(spec).on_trial_result(0, [], trial, result)

    check("eval/accuracy", plain)  # a round without evaluation holds no eval/* key
    check("server/kd_loss", evaluated)  # a server/* key may start after a warm-up: only the last round decides
    with pytest.raises(ConfigError, match="did you mean 'eval/accuracy'") as e:
        check("eval/acuracy", evaluated)
    assert e.value.key == "metric"
    with pytest.raises(ConfigError, match="'server/kd_loss' is not reported"):
        check("server/kd_loss", {**evaluated, "round": 3})
    with pytest.raises(ConfigError, match="diag/ens_acc"):
        check("diag/ens_acc", {"round": 1, "diag/ens_acc_eq7": 0.3})


@pytest.mark.ray
def test_a_metric_the_runs_do_not_report_stops_the_sweep_at_once(tmp_path, monkeypatch, capsys):
    """A typo in ``metric`` used to run every trial and end with an empty best trial (exit 0). The sweep starts a Ray
    of its own here, as `fedray tune` does, and shuts it down on the way out, stopped or not (the trial it stopped
    holds no CPU of the tests' shared Ray, which the other in-process sweeps use and leave up)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path / "typo.yaml", metric="eval/acuracy", search={"federation.lr": {"grid": [0.1, 0.05]}},
                      overrides={"tracking.experiment": "typo"}, trial_cpus=1, max_concurrent=1)
    assert main(["tune", str(spec), "--name", "t1"]) == 2
    assert not ray.is_initialized(), "the sweep left the Ray it started up"
    err = capsys.readouterr().err
    assert err.startswith("error: metric: 'eval/acuracy' is not reported") and "did you mean 'eval/accuracy'" in err
    parents, kids = children(MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"), "typo")
    assert [p.info.status for p in parents] == ["FAILED"] and [k.info.status for k in kids] == ["KILLED"]
    assert not (tmp_path / "sweeps" / "t1" / "best.json").exists()


def test_a_resume_mends_the_state_files_a_driver_killed_mid_save_cut_short(tmp_path):
    """Tune copies its state files again at each save, truncating each first: a SIGKILL then leaves them empty or
    cut. tuner.pkl comes back from fedray's copy; a state file that does not parse is moved aside; sound ones stay."""
    from fedray.sweep.folder import mend_state_files

    (tmp_path / "tuner.pkl.fedray").write_bytes(b"tuner state")
    (tmp_path / "tuner.pkl").write_bytes(b"")
    (tmp_path / "experiment_state-1.json").write_text('{"trial_data": []}')
    (tmp_path / "experiment_state-2.json").write_text("")
    searcher = pickle.dumps({"_uuid_prefix": "ab", "_total_samples": 2})  # Tune's searcher state: a pickle
    (tmp_path / "basic-variant-state-1.json").write_bytes(searcher)
    (tmp_path / "basic-variant-state-2.json").write_bytes(searcher[:-3])
    assert mend_state_files(tmp_path) == ["tuner.pkl put back from tuner.pkl.fedray",
                                           "basic-variant-state-2.json moved aside (cut short)",
                                           "experiment_state-2.json moved aside (cut short)"]
    assert (tmp_path / "tuner.pkl").read_bytes() == b"tuner state"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "basic-variant-state-1.json", "basic-variant-state-2.json.broken", "experiment_state-1.json",
        "experiment_state-2.json.broken", "tuner.pkl", "tuner.pkl.fedray"]
    assert mend_state_files(tmp_path) == []  # nothing left to mend


def test_tune_copies_none_of_fedrays_own_sweep_files_on_a_resume(tmp_path, monkeypatch):
    """On a resume Tune copies the sweep folder's top-level state files into its staging folder, and back at each
    save, truncating each first (a driver SIGKILLed then leaves them empty). fedray's sweep state and its copy of
    tuner.pkl must not be among them (Tune's own copying, run here); a sweep started under the old state name
    is still resumed (its state copied to the new name), and one whose old state file was cut short is refused
    naming --resume."""
    from ray.train._internal.storage import StorageContext
    from ray.tune.execution.experiment_state import _ExperimentCheckpointManager

    from fedray.sweep.folder import SWEEP_STATE, TUNER_COPY, TUNER_FILE, recorded_state
    from fedray.sweep.runner import latest_sweep, run_sweep

    sweep, staging = tmp_path / "sweeps" / "s-1", tmp_path / "staging"
    sweep.mkdir(parents=True)
    for name in (SWEEP_STATE, TUNER_COPY, TUNER_FILE, "experiment_state-1.json"):
        (sweep / name).write_text("{}")
    monkeypatch.setattr(StorageContext, "experiment_driver_staging_path", property(lambda self: str(staging)))
    storage = StorageContext(storage_path=str(sweep.parent), experiment_dir_name=sweep.name)
    _ExperimentCheckpointManager(storage=storage, checkpoint_period="auto").sync_down_experiment_state()
    assert sorted(p.name for p in staging.iterdir()) == ["experiment_state-1.json", TUNER_FILE]

    (sweep / SWEEP_STATE).rename(sweep / "fedray_sweep.json")
    assert latest_sweep("s", str(sweep.parent)) == "s-1"
    assert recorded_state(sweep) == {} and (sweep / SWEEP_STATE).read_text() == "{}"  # copied under the new name
    (sweep / SWEEP_STATE).unlink()
    (sweep / "fedray_sweep.json").write_text("")
    spec = load_spec(write_spec(tmp_path / "s.yaml", name="s-1", search={"federation.lr": {"grid": [0.1]}}))
    with pytest.raises(ConfigError, match="cut short") as e:
        run_sweep(spec, resume=True)
    assert e.value.key == "--resume"


def test_a_trials_value_is_its_metric_over_its_last_evaluated_rounds(tmp_path):
    from fedray.sweep.spec import trial_value

    spec = load_spec(write_spec(tmp_path / "s.yaml", search={"federation.lr": {"grid": [0.1]}}))
    assert spec.last_rounds == 5  # as fedray report's "last 5"
    history = [0.1, None, 0.9, float("nan"), 0.2, 0.4, 0.3, 0.5, 0.6]  # rounds without evaluation skipped
    assert trial_value(history, spec) == pytest.approx((0.2 + 0.4 + 0.3 + 0.5 + 0.6) / 5)
    spec.last_rounds = 1
    assert trial_value(history, spec) == 0.6 and trial_value([None], spec) is None


def test_a_restarted_trials_repeated_rounds_count_once(tmp_path):
    """A trial restarted from its checkpoint reports its last rounds again: its value takes each round once."""
    from types import SimpleNamespace

    import pandas as pd

    from fedray.sweep.runner import trial_rows

    spec = load_spec(write_spec(tmp_path / "s.yaml", search={"federation.lr": {"grid": [0.1]}}))
    frame = pd.DataFrame({"round": [1, 2, 3, 4, 5, 6, 5, 6], "eval/accuracy": [.1, .2, .3, .4, .9, .9, .5, .6]})
    done = SimpleNamespace(error=None, config={"federation.lr": 0.1}, metrics={"eval/accuracy": 0.6, "round": 6},
                           metrics_dataframe=frame, path="t0")
    failed = SimpleNamespace(error=RuntimeError("x"), config={}, metrics={}, metrics_dataframe=None, path="t1")
    (row,) = trial_rows([done, failed], spec)
    assert row.value == pytest.approx((.2 + .3 + .4 + .5 + .6) / 5) and row.path == "t0"


def test_the_best_of_a_sweep_over_seeds_is_the_setting_with_the_best_mean(tmp_path):
    """One seed's lucky run used to be the sweep's best: setting A (0.9 and 0.1 over two seeds) won over B (0.6
    and 0.6). Over seeds the best is the setting with the best mean, its figures averaged; without a seed
    dimension it stays the best trial."""
    from fedray.sweep.report import plot_sweep
    from fedray.sweep.spec import TrialRow, best_setting

    def row(mu, seed, acc):
        return TrialRow({"algorithm.mu": mu, "seed": seed}, {"val/accuracy": acc, "eval/accuracy": acc / 2,
                                                             "round": 3, "time/round_s": 1.0}, f"t-{mu}-{seed}", acc)

    rows = [row(0.1, 0, 0.9), row(0.1, 1, 0.1), row(1.0, 1, 0.6), row(1.0, 0, 0.6)]
    spec = load_spec(write_spec(tmp_path / "s.yaml", metric="val/accuracy", search={
        "algorithm.mu": {"grid": [0.1, 1.0]}, "seed": {"grid": [0, 1]}},
        overrides={"data.val_per_class": 5, "algorithm.name": "fedprox"}))
    best = best_setting(rows, spec)
    assert best["config"] == {"algorithm.mu": 1.0} and best["seeds"] == [0, 1]
    assert best["metric_value"] == pytest.approx(0.6) and best["metric_std"] == pytest.approx(0.0)
    assert best["metric_per_seed"] == {"0": 0.6, "1": 0.6} and best["trial_dirs"] == ["t-1.0-0", "t-1.0-1"]
    assert best["metrics"] == {"val/accuracy": pytest.approx(0.6), "eval/accuracy": pytest.approx(0.3),
                               "round": 3, "time/round_s": 1.0}
    spec.mode = "min"
    assert best_setting(rows, spec)["config"] == {"algorithm.mu": 0.1}
    spec.mode, spec.search = "max", {"algorithm.mu": spec.search["algorithm.mu"]}
    single = best_setting(rows, spec)
    assert single["config"] == {"algorithm.mu": 0.1, "seed": 0} and single["metric_value"] == 0.9
    # sweep.png marks the best setting on each of its parameters' panels, not on the seed's
    spec.search = load_spec(write_spec(tmp_path / "s.yaml", search={"algorithm.mu": {"grid": [0.1]},
                                                                     "seed": {"grid": [0, 1]}},
                                       overrides={"algorithm.name": "fedprox"})).search
    assert plot_sweep(rows, spec, best, tmp_path / "sweep.png").stat().st_size > 1000


@pytest.mark.ray
def test_an_optuna_sweep_of_two_settings_over_two_seeds_names_the_best_mean(tmp_path, monkeypatch, capsys, ray_local):
    """searcher: optuna through Ray Tune, with ASHA: 2 proposed settings x 2 seeds = 4 trials; best.json names
    the setting whose mean over its seeds of its trials' values (train/loss over their last rounds) is best,
    and each trial reported that value to the searcher as sweep/value. (On the tests' shared Ray, which the
    sweep leaves up: a Ray of the sweep's own is test_a_metric_the_runs_do_not_report_stops_the_sweep_at_once's.)"""
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path / "opt.yaml", search={"federation.lr": {"loguniform": [0.0001, 0.3]},
                                                      "seed": {"grid": [0, 1]}},
                      searcher="optuna", num_samples=2, startup_trials=2, metric="train/loss", mode="min",
                      trial_cpus=1, scheduler={"type": "asha", "grace_period": 3},
                      overrides={"tracking.experiment": "opt"})
    assert main(["tune", str(spec), "--name", "o1"]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    _, kids = children(client, "opt")
    assert len(kids) == 4 and all(k.info.status == "FINISHED" for k in kids)
    values: dict[str, list[float]] = {}
    for kid in kids:
        losses = [m.value for m in client.get_metric_history(kid.info.run_id, "train/loss")]
        assert kid.data.metrics["sweep/value"] == pytest.approx(np.mean(losses[-5:]))
        values.setdefault(kid.data.params["federation.lr"], []).append(np.mean(losses[-5:]))
    assert sorted(len(v) for v in values.values()) == [2, 2]  # two settings, each run with both seeds
    best = json.loads((tmp_path / "sweeps" / "o1" / "best.json").read_text())
    lr, seed_values = min(values.items(), key=lambda kv: np.mean(kv[1]))
    assert str(best["config"]["federation.lr"]) == lr and best["seeds"] == [0, 1]
    assert best["metric_value"] == pytest.approx(np.mean(seed_values))
    assert "best setting (mean over seeds 0, 1)" in capsys.readouterr().out


@pytest.mark.ray
def test_a_sweep_whose_every_trial_fails_exits_1_and_ends_failed(tmp_path, monkeypatch, capsys, ray_local):
    """Every trial failing (here: a partition no draw can satisfy, found only once a trial loads the data) used to
    end with exit 0, an empty best trial in best.json and the sweep's MLflow run FINISHED. (On the tests' shared
    Ray, which the sweep leaves up.)"""
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path / "fails.yaml", search={"federation.lr": {"grid": [0.1, 0.05]}},
                      overrides={"tracking.experiment": "fails", "data.min_samples": 5000}, trial_cpus=1)
    assert main(["tune", str(spec), "--name", "f1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: every trial of sweep f1 failed (2); the first: ") and "data.min_samples" in err
    assert "--resume" not in err  # a rerun would fail alike
    parents, kids = children(MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"), "fails")
    assert [p.info.status for p in parents] == ["FAILED"] and [k.info.status for k in kids] == ["FAILED"] * 2
    assert not (tmp_path / "sweeps" / "f1" / "best.json").exists()


def test_relative_paths_of_a_spec_still_name_their_folders_inside_a_trials_own_folder(tmp_path, monkeypatch):
    """Tune runs each trial in a folder of its own: a relative data.data_dir, or a base config given as a relative
    YAML path (with a relative data.cache_dir in it), named nothing there and every trial failed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"data": {"dataset": "synthetic", "cache_dir": "cache"}}))
    spec = load_spec(write_spec(tmp_path / "s.yaml", base="base.yaml", search={"federation.lr": {"grid": [0.1]}},
                                overrides={"data.data_dir": "data"}))
    monkeypatch.chdir(tmp_path / "data")  # as Tune does before a trial builds its config
    cfg = spec.trial_config({"federation.lr": 0.1})
    assert (cfg.data.data_dir, cfg.data.cache_dir) == (str(tmp_path / "data"), str(tmp_path / "cache"))
    searched = load_spec(write_spec(tmp_path / "g.yaml", search={"data.data_dir": {"grid": ["a", "../b"]}}))
    assert searched.search["data.data_dir"].grid == [str(tmp_path / "data" / "a"), str(tmp_path / "b")]


def _sweep_command(tmp_path, experiment: str, name: str, lrs: list[float], rounds: int):
    """A one-trial-at-a-time sweep over federation.lr run as `fedray tune` in a process: (cmd, env, MLflow URI)."""
    spec = write_spec(tmp_path / f"{experiment}.yaml", search={"federation.lr": {"grid": lrs}},
                      overrides={"federation.rounds": rounds, "federation.local_steps": 2,
                                 "tracking.experiment": experiment}, trial_cpus=1, max_concurrent=1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # create the tables before two processes use the store
    return ([sys.executable, "-m", "fedray.cli", "tune", str(spec), "--name", name],
            {**os.environ, "RAY_AUTH_MODE": "disabled"}, uri)


def _ray_children(proc) -> dict[psutil.Process, str]:
    """The driver's child processes (the local Ray it started), by name."""
    return {p: p.name() for p in psutil.Process(proc.pid).children(recursive=True)}


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)  # its subprocesses may wait 600 s
def test_a_sweep_stopped_by_ctrl_c_and_then_killed_resumes_each_time(tmp_path):
    """Ctrl-C mid-sweep: runs end KILLED, exit 130; `--resume` goes on from the trial's Tune checkpoint. That
    resumed driver SIGKILLed: the saved sweep state may name a trial checkpoint that newer ones have since replaced
    (deleted here, all of them, to make that certain). A second `--resume`, from another folder, must not fail
    that trial: it goes on from its run directory's own checkpoint (or from scratch), says so, and ends the sweep."""
    cmd, env, uri = _sweep_command(tmp_path, "long", "r1", [0.05, 0.1], rounds=20)
    sweep = tmp_path / "sweeps" / "r1"
    client = MlflowClient(uri)

    def rounds_logged(kid) -> list[int]:
        return [m.step for m in client.get_metric_history(kid.info.run_id, "comm/bytes_up")]

    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(240):
            time.sleep(0.5)
            kids = children(client, "long")[1] if client.get_experiment_by_name("long") else []
            if kids and len(rounds_logged(kids[0])) >= 5:
                break
        else:
            pytest.fail("the sweep never got going")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, proc.stderr.read()[-3000:]
    finally:
        proc.kill()
    parents, kids = children(client, "long")
    assert [p.info.status for p in parents] == ["KILLED"] and [k.info.status for k in kids] == ["KILLED"]
    interrupted = kids[0]

    proc = subprocess.Popen(cmd + ["--resume"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    started: dict[psutil.Process, str] = {}
    try:
        for _ in range(960):  # until the resumed trial has run on and the saved state names a trial checkpoint
            time.sleep(0.25)
            rerun = [k for k in children(client, "long")[1] if k.info.run_id != interrupted.info.run_id
                     and k.data.tags.get("fedray.trial_id") == interrupted.data.tags["fedray.trial_id"]]
            states = list(sweep.glob("experiment_state-*.json"))
            if (rerun and len(rounds_logged(rerun[0])) >= 3 and states
                    and re.search(r"checkpoint_\d{6}", states[0].read_text(errors="replace"))):
                break
        else:
            pytest.fail("the resumed sweep never went on")
        started = _ray_children(proc)
    finally:
        proc.kill()  # SIGKILL: no handler runs, nothing is saved on the way out
        proc.wait(timeout=60)
    steps = rounds_logged(rerun[0])
    assert min(steps) > 1, "the interrupted trial did not resume from its Tune checkpoint"
    # the local Ray it started goes down with it, but for Ray's dashboard and runtime-env agents, which linger
    # until the next local Ray fedray starts (the resume below) stops them
    agents = [p for p, name in started.items() if name.endswith("Agent")]
    _, alive = psutil.wait_procs([p for p in started if p not in agents], timeout=60)
    assert not alive, f"the killed sweep's Ray outlived it: {alive}"
    for ckpt in sweep.glob("_trial_*/checkpoint_*"):
        subprocess.run(["rm", "-rf", str(ckpt)], check=True)

    # resumed from another folder: the sweep goes on in the default store of the folder it started from
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(cmd + ["--resume"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    lingering = [p for p in agents if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not lingering, f"the killed sweep's Ray agents outlived the resumed sweep's start: {lingering}"
    assert not (elsewhere / "mlflow.db").exists()
    assert "its checkpoint in the sweep's saved state was gone" in done.stdout, done.stdout[-3000:]
    best = json.loads((sweep / "best.json").read_text())
    assert best["trials"] == 2 and best["errored"] == 0 and best["metrics"]["round"] == 20, done.stdout[-3000:]
    parents, kids = children(client, "long")
    assert [p.info.status for p in parents] == ["FINISHED"]
    # the Ctrl-C'd and the SIGKILLed drivers' children ended KILLED; each trial finished in a child of its own
    assert sorted(k.info.status for k in kids) == ["FINISHED", "FINISHED", "KILLED", "KILLED"], done.stdout[-3000:]
