"""MLflow on every run: params, tags, per-round metrics, artifacts, and an end status that is never RUNNING."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from fedray.methods import register_algorithm
from fedray.methods.fedavg import FedAvg
from fedray.cli import main
from fedray.record.run_dir import RESULT_FILES
from fedray.simulation import run_experiment
from fedray.errors import clear_interrupted, interrupt
from fedray.record.tracking import MlflowTracker, RunTracking, resolve_tracking_uri
from tests.conftest import tiny_config
from tests.test_cli import TINY_ARGS

ARTIFACTS = {"config.yaml", "summary.json", "history.parquet", "clients.parquet", "curves.png", "partition.png",
             "model.pt"}


def test_artifacts_are_the_result_files():
    assert set(RESULT_FILES) == ARTIFACTS and len(RESULT_FILES) == len(ARTIFACTS)


def _runs(uri, experiment="fedray"):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client, ([] if exp is None else client.search_runs([exp.experiment_id]))


def test_fedray_run_is_tracked_in_a_local_sqlite_store(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = [a for a in TINY_ARGS if not a.startswith("tracking.")]
    assert main(["run", *args, "seed=3", "--output-dir", "out", "--no-progress"]) == 0
    out = capsys.readouterr().out
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert resolve_tracking_uri(None) == uri
    client, runs = _runs(uri)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["seed"] == "3" and run.data.params["data.num_clients"] == "6"
    assert run.data.params["algorithm.name"] == "fedavg"
    tags = run.data.tags
    assert tags["fedray.algorithm"] == "fedavg" and tags["fedray.dataset"] == "synthetic"
    assert tags["fedray.version"] and tags["fedray.kind"] == "run"
    acc = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert sorted(m.step for m in acc) == [2, 3]  # eval_every=2: rounds 2 and 3 (the last)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "comm/bytes_up")) == [1, 2, 3]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == ARTIFACTS
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.artifact_location == (tmp_path / "mlartifacts").as_uri()
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow 3's kind for training
    # The run says, once, how to open it, on the UI's model-training view (not its GenAI view).
    assert out.count("MLflow:") == 1
    assert (f"MLflow: mlflow ui --backend-store-uri {uri} --port 5000, then open http://127.0.0.1:5000/"
            f"#/experiments/{exp.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning") in out


def test_experiment_kind_is_set_once_and_a_chosen_kind_is_kept(tmp_path):
    from fedray.record.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_experiment("old")  # made before fedray set kinds: gets ours
    client.create_experiment("theirs", tags={"mlflow.experimentKind": "finetuning"})
    for name in ("old", "theirs", "new"):
        MlflowTracker(uri, name)
    kinds = {n: client.get_experiment_by_name(n).tags["mlflow.experimentKind"] for n in ("old", "theirs", "new")}
    assert kinds == {"old": "custom_model_development", "theirs": "finetuning", "new": "custom_model_development"}


@register_algorithm
class FailsInRound2(FedAvg):
    name = "test_fails_in_round_2"

    def server_update(self, state, uploads, ctx):
        if ctx.round == 2:
            raise self.exc_type("injected failure")
        return super().server_update(state, uploads, ctx)

    exc_type = RuntimeError


@register_algorithm
class InterruptedInRound2(FailsInRound2):
    name = "test_interrupted_in_round_2"
    exc_type = KeyboardInterrupt


@pytest.mark.parametrize("name, exc, status", [("test_fails_in_round_2", RuntimeError, "FAILED"),
                                               ("test_interrupted_in_round_2", KeyboardInterrupt, "KILLED")])
def test_failed_or_interrupted_runs_are_ended_not_left_running(name, exc, status, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(algorithm__name=name, tracking__uri=uri)
    tracking = RunTracking(cfg)
    with pytest.raises(exc):
        run_experiment(cfg, tmp_path / "out", progress=False, hooks=[tracking])
    client, runs = _runs(uri)
    assert [r.info.status for r in runs] == [status]
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "eval/accuracy")] == [1]
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_new_run_in_an_old_runs_folder_replaces_it(tmp_path, caplog):
    """Killed midway, a new run must not sit beside the old summary.json (which marks a finished run)."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("summary.json", "clients.json", "history.parquet", "notes.txt"):
        (out / name).write_text("from an earlier run")
    cfg = tiny_config(algorithm__name="test_fails_in_round_2", tracking__enabled=False)
    with pytest.raises(RuntimeError):
        run_experiment(cfg, out, progress=False)
    left = {p.name for p in out.iterdir()}
    assert "notes.txt" in left and not left & {"summary.json", "clients.json", "history.parquet"}
    assert "held an earlier run" in caplog.text and "summary.json" in caplog.text


class _FailsOnStart:
    """A hook after tracking that raises in on_start: the MLflow run already started must still end."""

    def __init__(self):
        self.errors = []

    def on_start(self, cfg, data):
        raise RuntimeError("hook broke")

    def on_round(self, row): ...

    def on_end(self, result): ...

    def on_error(self, exc):
        self.errors.append(exc)


def test_a_hook_failing_at_start_ends_the_started_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(tracking__uri=uri)
    broken = _FailsOnStart()
    with pytest.raises(RuntimeError, match="hook broke"):
        run_experiment(cfg, tmp_path / "out", progress=False, hooks=[RunTracking(cfg), broken])
    assert [r.info.status for r in _runs(uri)[1]] == ["FAILED"]
    assert [str(e) for e in broken.errors] == ["hook broke"]  # the hook that raised is told too


def test_a_run_file_that_cannot_be_written_leaves_no_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(tracking__uri=uri)
    (tmp_path / "afile").write_text("x")
    tracking = RunTracking(cfg, run_file=tmp_path / "afile" / "out" / "mlflow_run.json")
    with pytest.raises(NotADirectoryError):
        run_experiment(cfg, None, progress=False, hooks=[tracking])
    assert _runs(uri)[1] == []


def test_artifacts_that_cannot_be_logged_fail_the_run(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(tracking__uri=uri)
    tracking = RunTracking(cfg)

    def full_disk(folder):
        raise OSError("No space left on device")

    monkeypatch.setattr(tracking.tracker, "log_artifacts", full_disk)
    with pytest.raises(OSError, match="No space"):
        run_experiment(cfg, tmp_path / "out", progress=False, hooks=[tracking])
    assert [r.info.status for r in _runs(uri)[1]] == ["FAILED"]


def test_a_relative_sqlite_uri_is_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_tracking_uri("sqlite:///sub/runs.db?timeout=5") == f"sqlite:///{tmp_path}/sub/runs.db?timeout=5"
    for uri in ("sqlite:////abs/runs.db", "sqlite:///:memory:", "http://127.0.0.1:5000"):
        assert resolve_tracking_uri(uri) == uri


def test_bad_tracking_uri_is_refused_before_work(tmp_path, capsys):
    code = main(["run", *TINY_ARGS, "tracking.enabled=true", "tracking.uri=nosuchscheme://x",
                 "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: tracking.uri: cannot use MLflow store")
    assert not (tmp_path / "out").exists()


def test_sigterm_ends_the_run_killed(tmp_path):
    """A real process killed by SIGTERM (a scheduler's preemption) leaves its MLflow run KILLED."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [a for a in TINY_ARGS if not a.startswith(("tracking.", "federation.rounds"))]
    cmd = [sys.executable, "-m", "fedray.cli", "run", *args, "federation.rounds=100000", "runtime.checkpoint_every=1", f"tracking.uri={uri}",
           "--output-dir", str(tmp_path / "out"), "--no-progress"]
    MlflowClient(uri).search_experiments()  # create the tables first: two processes must not both migrate
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until the run exists and has logged a round
            time.sleep(0.5)
            client, runs = _runs(uri)
            if runs and client.get_metric_history(runs[0].info.run_id, "comm/bytes_up"):
                break
        else:
            pytest.fail("the run never started: " + (proc.stderr.read() if proc.poll() is not None else ""))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    _, runs = _runs(uri)
    assert [r.info.status for r in runs] == ["KILLED"]
    assert not (tmp_path / "out" / "summary.json").exists()  # no result presented as complete
    assert (tmp_path / "out" / "checkpoint.pt").exists()  # but resumable


def test_an_interrupt_during_an_mlflow_write_stops_the_run_after_the_write(tmp_path, monkeypatch):
    """A first Ctrl-C / SIGTERM landing inside a write to MLflow is raised once the write is done: a write cut
    mid-transaction can leave the SQLite store locked, and the run's KILLED status then cannot be written. A
    second one (a write that hangs) is raised at once."""
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "deferral")
    run_id = tracker.start(tiny_config())
    write = tracker.client.log_batch

    def interrupted(*args, **kwargs):
        interrupt()  # what the signal handler does, here in the middle of the write
        return write(*args, **kwargs)

    monkeypatch.setattr(tracker.client, "log_batch", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            tracker.log_round({"round": 1, "train/loss": 0.5})
        with pytest.raises(KeyboardInterrupt):
            tracker.log_round({"round": 2, "train/loss": 0.25})
        tracker.end("KILLED")
    finally:
        clear_interrupted()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert [m.value for m in client.get_metric_history(run_id, "train/loss")] == [0.5]  # round 2's never began
    assert client.get_run(run_id).info.status == "KILLED"


class _StopAfterRound2:
    """Ends a run after its round-2 checkpoint, as a kill would."""

    def on_start(self, cfg, data): ...

    def on_round(self, row):
        if row["round"] == 2:
            raise KeyboardInterrupt

    def on_end(self, result): ...

    def on_error(self, exc): ...


def _tracked_unfinished_run(out):
    """A tracked run stopped after round 2 of 3, in the default store ``./mlflow.db``."""
    cfg = tiny_config(federation__rounds=3, tracking__enabled=True)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out, progress=False,
                       hooks=[RunTracking(cfg, run_file=out / "mlflow_run.json"), _StopAfterRound2()])


def test_a_run_resumed_from_another_folder_continues_in_its_store(tmp_path, monkeypatch):
    """The default store is ./mlflow.db of the folder a run started from; resumed elsewhere, the run used to
    crash in MLflow ("Run ... not found") after creating a stray store in the new folder."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    _tracked_unfinished_run(tmp_path / "a" / "out")
    monkeypatch.chdir(tmp_path / "b")
    assert main(["run", "--resume", str(tmp_path / "a" / "out"), "--no-progress"]) == 0
    assert not (tmp_path / "b" / "mlflow.db").exists()
    client, runs = _runs(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}")
    assert [r.info.status for r in runs] == ["FINISHED"]
    # round 2, the last checkpointed, is logged again on resume (identical values: a duplicate, never a gap)
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "comm/bytes_up")) == [1, 2, 2, 3]

    # resumed into another store (a relative SQLite URI: from the current folder): a new run holds every round
    monkeypatch.chdir(tmp_path / "a")
    _tracked_unfinished_run(tmp_path / "a" / "out2")
    monkeypatch.chdir(tmp_path / "b")
    assert main(["run", "--resume", str(tmp_path / "a" / "out2"), "tracking.uri=sqlite:///other.db",
                 "--no-progress"]) == 0
    uri = f"sqlite:///{tmp_path / 'b' / 'other.db'}"
    client, runs = _runs(uri)
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "comm/bytes_up")) == [1, 2, 3]
    assert json.loads((tmp_path / "a" / "out2" / "mlflow_run.json").read_text()) == {
        "tracking_uri": uri, "run_id": runs[0].info.run_id}
