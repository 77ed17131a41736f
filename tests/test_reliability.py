"""Reliability, with faults injected for real: SIGKILL of the driver, killed worker and server processes,
a removed node, stragglers, non-finite uploads, corrupt checkpoints."""

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import cloudpickle
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from fedray.record.checkpoint import FILENAME, CheckpointError, decode, encode, load_checkpoint, save_checkpoint
from fedray.cli import main
from fedray.load import load_config
from fedray.data import build_federated_data
from fedray.errors import RunFailure, clear_interrupted, interrupt
from fedray.seeding import sample_clients
from fedray.simulation import RunHooks, run_experiment
from tests.conftest import object_of_a_dead_owner, tiny_config
from tests.runtime import faulty

cloudpickle.register_pickle_by_value(faulty)  # Ray workers cannot import tests/

FIGURES = ("eval/accuracy", "eval/amp", "eval/fm", "eval/wlp", "eval/best_accuracy", "comm/bytes_up",
           "comm/bytes_down", "rounds")
ARGS = ["synthetic", "data.num_clients=6", "federation.clients_per_round=3", "data.synthetic_train_samples=600",
        "data.synthetic_test_samples=200", "federation.rounds=5", "federation.local_steps=150",
        "federation.batch_size=16", "--no-progress"]
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def _cfg_of_args(**extra):
    """The experiment of ARGS, built in-process (``__`` for dots in extra overrides)."""
    overrides = [a for a in ARGS[1:] if "=" in a] + ["tracking.enabled=false"]
    overrides += [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
    return load_config(ARGS[0], overrides)


def _ckpt_round(folder) -> int:
    try:
        return load_checkpoint(folder)["round"]
    except CheckpointError:
        return 0


# --- checkpoint format ------------------------------------------------------------------------------

@dataclass
class _Inner:
    w: torch.Tensor
    n: int


def test_typed_state_round_trips_and_loads_without_pickle(tmp_path):
    from fedray.methods.fedavg import ModelState

    state = {"server": ModelState({"a": torch.arange(3.0)}), "clients": {2: None, 5: [1.5, "x", True]}}
    save_checkpoint(tmp_path, {"round": 3, "state": state})
    back = load_checkpoint(tmp_path)
    assert back["round"] == 3 and torch.equal(back["state"]["server"].weights["a"], torch.arange(3.0))
    assert isinstance(back["state"]["server"], ModelState)
    assert back["state"]["clients"] == {2: None, 5: [1.5, "x", True]}
    # a class from outside fedray and the registered methods is refused, not imported
    foreign = encode(_Inner(torch.ones(1), 1))
    foreign["__dataclass__"] = "os.path:join"
    with pytest.raises(CheckpointError, match="refusing"):
        decode(foreign)


def test_state_classes_named_by_their_former_modules_still_load():
    """A checkpoint written before the package's present layout names fedray.algorithms.*: it still resumes."""
    from fedray.learning.cached import ModelCache
    from fedray.methods.dafkd import DaFKDClientState
    from fedray.methods.fedavg import ModelState

    for old, cls in [("fedray.algorithms.fedavg:ModelState", ModelState),
                     ("fedray.algorithms.dafkd:DaFKDClientState", DaFKDClientState),
                     ("fedray.algorithms.cached:ModelCache", ModelCache)]:
        enc = encode(cls(**{f.name: None for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}))
        enc["__dataclass__"] = old
        assert type(decode(enc)) is cls


class _StopAfterRound2(RunHooks):
    """Ends a run after its round-2 checkpoint, as a kill would."""

    def on_round(self, row):
        if row["round"] == 2:
            raise KeyboardInterrupt


def _unfinished_run(folder):
    with pytest.raises(KeyboardInterrupt):
        run_experiment(tiny_config(federation__rounds=3), folder, progress=False, hooks=[_StopAfterRound2()])


def test_corrupt_foreign_and_malicious_checkpoints_are_refused(tmp_path, capsys):
    _unfinished_run(tmp_path / "run")
    good = (tmp_path / "run" / FILENAME).read_bytes()
    (tmp_path / "run" / f".{FILENAME}.tmp").write_bytes(good[:100])  # a crash mid-write leaves this behind
    assert load_checkpoint(tmp_path / "run")["round"] == 2  # the previous checkpoint is still good
    assert not (tmp_path / "run" / "summary.json").exists()

    cases = {
        "truncated": good[: len(good) // 2],
        "garbage": b"not a checkpoint at all",
    }
    for name, blob in cases.items():
        (tmp_path / "run" / FILENAME).write_bytes(blob)
        assert main(["run", "--resume", str(tmp_path / "run"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --resume:") and "corrupt" in err[0], (name, err)
    torch.save({"weights": torch.ones(2)}, tmp_path / "run" / FILENAME)  # a torch file, not ours
    assert main(["run", "--resume", str(tmp_path / "run")]) == 2
    assert "not a fedray checkpoint" in capsys.readouterr().err
    torch.save({"format": "fedray-checkpoint", "obj": _Inner(torch.ones(1), 1)}, tmp_path / "run" / FILENAME)
    assert main(["run", "--resume", str(tmp_path / "run")]) == 2  # unpickling it would run foreign code
    assert "corrupt or not a fedray checkpoint" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path / "nothing-here")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_resume_refuses_another_experiment_and_finished_runs(tmp_path, capsys):
    run_experiment(tiny_config(federation__rounds=2), tmp_path / "done", progress=False)
    assert main(["run", "--resume", str(tmp_path / "done")]) == 2
    assert "to extend it, add federation.rounds=N" in capsys.readouterr().err
    _unfinished_run(tmp_path / "run")
    assert main(["run", "--resume", str(tmp_path / "run"), "data.alpha=0.3", "tracking.enabled=false"]) == 2
    assert "data.alpha" in capsys.readouterr().err


EXTENDED = ["tracking.enabled=true", "algorithm.name=scaffold", "federation.optimizer=sgd", "federation.lr=0.1",
            "data.num_clients=4", "federation.clients_per_round=2", "--no-progress"]


def test_a_finished_run_extended_gives_the_figures_of_the_run_started_that_long(tmp_path):
    """``fedray run --resume DIR federation.rounds=5`` on a finished 3-round run (SCAFFOLD: server and client
    state) goes on from its final state: history, summary figures and clients.parquet are those of a run started
    with 5 rounds, and MLflow holds one run, FINISHED, with rounds 1-5."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["synthetic", *EXTENDED, f"tracking.uri={uri}"]
    assert main(["run", *args, "federation.rounds=5", "--output-dir", str(tmp_path / "five")]) == 0
    assert main(["run", *args, "federation.rounds=3", "--output-dir", str(tmp_path / "three")]) == 0
    assert load_checkpoint(tmp_path / "three")["round"] == 3  # a finished run keeps its last checkpoint
    assert main(["run", "--resume", str(tmp_path / "three"), "federation.rounds=5", "--no-progress"]) == 0
    five, three = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("five", "three"))
    assert {k: three[k] for k in FIGURES} == {k: five[k] for k in FIGURES} and three["rounds"] == 5
    for name in ("history.parquet", "clients.parquet"):
        a, b = (pq.read_table(tmp_path / d / name).to_pandas() for d in ("five", "three"))
        keep = [c for c in a.columns if not c.startswith(("time/", "sys/"))]
        assert a[keep].equals(b[keep]), name
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("fedray").experiment_id])
    extended = next(r for r in runs if r.info.run_id == json.loads((tmp_path / "three" / "mlflow_run.json")
                                                                    .read_text())["run_id"])
    assert extended.info.status == "FINISHED" and len(runs) == 2
    assert sorted({m.step for m in client.get_metric_history(extended.info.run_id, "eval/accuracy")}) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("setting, error", [
    ("federation.rounds=3", "finished run of 3 rounds"),
    ("federation.rounds=5 federation.lr=0.5", "another experiment (federation.lr differ)"),
    ("federation.rounds=5", "lr_schedule=cosine"),  # the run was cosine: every round's lr depends on the total
])
def test_an_extension_that_cannot_give_the_longer_runs_figures_is_refused_in_one_line(tmp_path, capsys, setting, error):
    run_experiment(tiny_config(federation__rounds=3, federation__lr_schedule="cosine",
                               federation__lr_min=0.0), tmp_path / "run", progress=False)
    assert main(["run", "--resume", str(tmp_path / "run"), *setting.split(), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and error in err[0], err


def test_a_finished_run_without_a_checkpoint_cannot_be_extended(tmp_path, capsys):
    run_experiment(tiny_config(federation__rounds=2, runtime__checkpoint_every=0), tmp_path / "run", progress=False)
    assert main(["run", "--resume", str(tmp_path / "run"), "federation.rounds=3", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without a checkpoint (runtime.checkpoint_every=0)" in err[0], err


def test_an_extension_past_a_last_round_evaluated_only_as_the_last_is_refused(tmp_path, capsys):
    run_experiment(tiny_config(federation__rounds=3, federation__eval_every=2), tmp_path / "run", progress=False)
    assert main(["run", "--resume", str(tmp_path / "run"), "federation.rounds=4", "--no-progress"]) == 2
    assert "federation.eval_every=2: round 3 was evaluated only as the last round" in capsys.readouterr().err
    assert (tmp_path / "run" / "summary.json").is_file()  # refused before any work: still the finished run


def test_resume_after_the_command_as_first_typed(tmp_path, capsys):
    """``fedray run CONFIG [overrides] --resume DIR``: the command that started the run, --resume appended."""
    import yaml

    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(tiny_config(federation__rounds=3).model_dump(mode="json")))
    with pytest.raises(KeyboardInterrupt):
        run_experiment(load_config(str(spec), ["federation.lr=0.02"]), tmp_path / "run", progress=False,
                       hooks=[_StopAfterRound2()])
    run = str(tmp_path / "run")
    # another experiment: refused in one line naming what differs, before any work (the checkpoint is untouched)
    assert main(["run", str(spec), "federation.lr=0.03", "tracking.enabled=false", "--resume", run]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "federation.lr" in err[0] and load_checkpoint(run)["round"] == 2
    assert main(["run", str(spec), "--resume", run, "tracking.enabled=false", "--no-progress"]) == 2  # lr 0.05
    assert "federation.lr" in capsys.readouterr().err
    # the same experiment, where it runs and how it is tracked free to differ: it continues to the end
    assert main(["run", str(spec), "federation.lr=0.02", "tracking.enabled=false", "runtime.checkpoint_every=1",
                 "--resume", run, "--no-progress"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds"] == 3


class _CtrlCInFinaliser(RunHooks):
    """A Ctrl-C that lands while a finaliser runs: Python prints "Exception ignored" and drops it."""

    def __init__(self):
        self.rounds = []

    def on_round(self, row):
        self.rounds.append(row["round"])
        if row["round"] == 1:
            type("Finalised", (), {"__del__": lambda self: interrupt()})()  # collected at once


def test_ctrl_c_dropped_in_a_finaliser_still_stops_the_run():
    hook = _CtrlCInFinaliser()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_experiment(tiny_config(federation__rounds=4), progress=False, hooks=[hook])
    finally:
        clear_interrupted()
    assert hook.rounds == [1]


# --- SIGKILL and exact resume -----------------------------------------------------------------------

def _orphaned_ray_agents() -> list[int]:
    from fedray.runtime.ray_start import orphaned_ray_agents

    return [p.pid for p in orphaned_ray_agents()]


# Per-client models of two architectures (each client's own weights are its state) and a server that distils:
# FedCD's, on Ray, where the clients' own models live in the workers (fedray/runtime/personal.py).
FEDCD = ["algorithm.name=fedcd", "model.client_models=[lenet5,resnet8]", "data.server_data.kind=holdout",
         "data.server_data.per_class=10", "federation.local_steps=20", "runtime.backend=ray"]  # ~1 s a round


def _kill_after_checkpoint(cmd, cwd, out, round_: int, during: bool) -> int:
    """Start ``cmd`` and SIGKILL it once its checkpoint holds ``round_``: at once (between rounds) or ``during``
    the next round. The round of the checkpoint it left."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while _ckpt_round(out) < round_ and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert _ckpt_round(out) >= round_, "no checkpoint appeared"
        if during:
            time.sleep(0.4)  # a round here takes about a second: kill it halfway
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert _ckpt_round(out) < 5 and not (out / "summary.json").exists(), "the run ended before it was killed"
    return _ckpt_round(out)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)  # its resume may take 300 s
def test_sigkilled_run_resumes_to_identical_figures(tmp_path):
    """Killed right after a checkpoint, resumed, and its resume killed mid-round: the second resume ends with the
    uninterrupted run's figures, each round once in clients.parquet and MLflow, and no Ray process of the killed
    drivers left."""
    reference = run_experiment(_cfg_of_args(**dict(e.replace(".", "__", 1).split("=", 1) for e in FEDCD
                                                    if not e.startswith("runtime."))), progress=False).summary
    out = tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # create the tables before two processes use the store
    resume = [sys.executable, "-m", "fedray.cli", "run", "--resume", str(out), "--no-progress"]
    cmd = [sys.executable, "-m", "fedray.cli", "run", *ARGS, *FEDCD, f"tracking.uri={uri}", "--output-dir", str(out)]
    killed_at = 1
    for i, when in enumerate(("between", "during")):  # each kill a round or more past the last one's checkpoint
        killed_at = _kill_after_checkpoint(cmd if i == 0 else resume, tmp_path, out, killed_at + 1, when == "during")
    orphans = _orphaned_ray_agents()  # a SIGKILLed driver's Ray leaves these behind
    assert not (out / "clients.parquet").exists()  # written only when the run has finished
    done = subprocess.run(resume, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not set(orphans) & set(_orphaned_ray_agents()), "the killed driver's Ray agents outlived the next run"
    resumed = json.loads((out / "summary.json").read_text())
    assert {k: resumed[k] for k in FIGURES} == {k: reference[k] for k in FIGURES}
    clients = pq.read_table(out / "clients.parquet")  # each (round, client) once: none lost, none from the killed round
    assert list(zip(clients["round"].to_pylist(), clients["client"].to_pylist())) == [
        (r, c) for r in range(1, 6) for c in range(6)]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("fedray").experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"]  # the same MLflow run, continued
    history = client.get_metric_history(runs[0].info.run_id, "eval/accuracy")
    assert sorted({m.step for m in history}) == list(range(1, 6))
    by_step = {}
    for m in history:  # a round re-run after the kill logs the very same value again
        assert by_step.setdefault(m.step, m.value) == m.value


# --- non-finite uploads -----------------------------------------------------------------------------

def test_nonfinite_upload_is_rejected_and_logged(caplog):
    """The rejected upload is not the server's work either: its simulated work counts the 2 uploads it kept."""
    cfg = tiny_config(algorithm__name="test_nan_client", data__num_clients=3, federation__clients_per_round=3,
                      federation__rounds=3, system__devices="heterogeneous")
    with caplog.at_level(logging.WARNING, logger="fedray"):
        result = run_experiment(cfg, progress=False)
    assert [row["health/rejected_updates"] for row in result.history] == [0.0, 1.0, 0.0]
    assert [row["sim/server_samples"] for row in result.history] == [30.0, 20.0, 30.0]
    assert [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()] == [
        "round 2: rejected a non-finite upload from client 1"]
    assert all(row["eval/accuracy"] == row["eval/accuracy"] for row in result.history)  # never NaN


def test_all_uploads_nonfinite_stops_with_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", *ARGS, "algorithm.name=test_nan_everyone", "federation.local_steps=2",
                 "tracking.enabled=false", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0] == ("error: round 2: every upload was non-finite (clients 0, 3, 4); the run stops with its last good "
                      "checkpoint intact; lower federation.lr or check the data; continue from the last checkpoint "
                      f"with: fedray run --resume {out}")
    assert load_checkpoint(out)["round"] == 1 and not (out / "summary.json").exists()


# --- worker, straggler, server and node failures on Ray ----------------------------------------------

def _inject(gate, during, rt, errors):
    """Once every worker holds a client of the held round: ``during(rt)``, then the clients are released."""
    try:
        gate.wait_started(rt.pool.pids)
        during(rt)
    except BaseException as e:  # raised in the test's thread once the round is over
        errors.append(e)
    finally:
        gate.release()


def _run_rounds(cfg, rounds, during=None):
    """Rounds on a RayRuntime; ``during(rt)`` runs in a thread while every worker holds a client of round 2 (the
    ``test_held_*`` methods wait for the test's release: no race with the round's end, whatever the load).
    ``during`` may also be {round: fault}: each fault injected so in its round."""
    from fedray.runtime.ray_runtime import RayRuntime

    faults = during if isinstance(during, dict) else {2: during} if during else {}
    data = build_federated_data(cfg.data, cfg.seed)
    out, errors = [], []
    gate = None
    try:
        with RayRuntime(cfg, data) as rt:
            for r in range(1, rounds + 1):
                t = None
                if r in faults:
                    gate = faulty.Gate(r)  # holds round r's clients (and clears the last round's files)
                    t = threading.Thread(target=_inject, args=(gate, faults[r], rt, errors))
                    t.start()
                o = rt.run_round(r, sample_clients(cfg.seed, r, data.num_clients, cfg.federation.clients_per_round))
                if t:
                    t.join()
                    if errors:
                        raise errors[0]
                out.append(({i["client"]: i["train/loss"] for i in o.client_infos}, o.server_metrics))
            out.append(rt.evaluate())
            pool = len(rt.pool.workers)
    finally:
        if gate:
            gate.close()
    return out, pool


def _kill_a_worker(rt):
    """SIGKILL worker 0 while it holds a round-2 client."""
    os.kill(rt.pool.pids[0], signal.SIGKILL)


def _kill_every_worker(rt):
    for pid in rt.pool.pids:
        os.kill(pid, signal.SIGKILL)


def _lose_the_data_then_kill_a_worker(rt):
    """The dataset's object is lost (the runtime's reference now names an object whose owner died, as when
    the node holding it goes), then worker 0 is SIGKILLed: it must restart all the same."""
    rt.pool.data_ref = object_of_a_dead_owner(rt.pool.data)
    os.kill(rt.pool.pids[0], signal.SIGKILL)


# The faults of test_killed_workers_cost_only_a_retry, each in a round of its own followed by a fault-free one (as
# when each had a run of its own): one faulted run and one fault-free run for the three, not four runs on Ray.
KILLS = {2: _lose_the_data_then_kill_a_worker, 4: _kill_a_worker, 6: _kill_every_worker}


@pytest.mark.ray
@pytest.mark.slow
def test_killed_workers_cost_only_a_retry(ray_local, caplog):
    """With no live worker left, the client waits for a restart rather than spending its retries. A worker
    restarts even when the dataset's object is gone: the driver attaches the data again. (The dataset's object is
    lost in round 2, before any other fault: its message can come from that fault only.)"""
    cfg = _cfg_of_args(runtime__backend="ray", federation__rounds=7, algorithm__name="test_held_round",
                       federation__local_steps=10)
    clean, _ = _run_rounds(cfg, 7)
    with caplog.at_level(logging.WARNING, logger="fedray"):
        faulted, pool = _run_rounds(cfg, 7, during=KILLS)
    # A worker's clients of the round are one task: they are rerun together (one client: "lost its worker")
    lines = caplog.text.splitlines()
    for r, kill in KILLS.items():
        assert any(f"round {r}: " in line and (" lost their worker " in line or " lost its worker " in line)
                   and "; rerunning " in line for line in lines), (kill.__name__, caplog.text)
    assert "dropped" not in caplog.text
    assert faulted == clean  # same losses, same aggregate, same evaluation
    assert pool == 2  # the killed workers restarted in place
    assert "the dataset's object was lost from the object store; putting it again" in caplog.text


@pytest.mark.ray
def test_a_killed_worker_reruns_its_batched_clients_one_by_one(ray_local, caplog):
    """Vectorised clients: a worker killed while it trains its clients as one task costs a rerun of that task
    on a live worker, batched as before, so the figures are the fault-free ones exactly."""
    cfg = _cfg_of_args(runtime__backend="ray", federation__rounds=3, algorithm__name="test_held_plan",
                       federation__local_steps=10,
                       runtime__vectorize=True)
    clean, _ = _run_rounds(cfg, 3)
    with caplog.at_level(logging.WARNING, logger="fedray"):
        faulted, pool = _run_rounds(cfg, 3, during=_kill_a_worker)
    assert "round 2: clients 0, 4 lost their worker" in caplog.text and "rerunning them together" in caplog.text
    assert "dropped" not in caplog.text
    assert faulted == clean  # same losses, same aggregate, same evaluation
    assert pool == 2


@pytest.mark.ray
def test_no_actor_restart_depends_on_an_object_in_the_store(ray_local, capfd):
    """Ray warns when a restartable actor's constructor arguments live in the object store (such an actor
    cannot restart once that object is lost): the client workers take small arguments only."""
    from fedray.runtime.ray_runtime import RayRuntime

    cfg = tiny_config(runtime__backend="ray")
    with RayRuntime(cfg, build_federated_data(cfg.data, cfg.seed)) as rt:
        rt.run_round(1, [0, 1, 2])
    time.sleep(0.5)  # Ray's log lines reach the driver's stderr asynchronously
    assert "constructor arguments in the object store" not in capfd.readouterr().err


@pytest.mark.ray
@pytest.mark.slow
def test_client_dropped_after_max_retries(ray_local, caplog):
    cfg = _cfg_of_args(runtime__backend="ray", federation__rounds=2, runtime__max_client_retries=0,
                       algorithm__name="test_held_round", federation__local_steps=10)
    with caplog.at_level(logging.WARNING, logger="fedray"):
        faulted, _ = _run_rounds(cfg, 2, during=_kill_a_worker)
    assert "dropped client" in caplog.text
    assert faulted[1][1]["health/dropped_clients"] >= 1 and faulted[0][1]["health/dropped_clients"] == 0


@pytest.mark.ray
@pytest.mark.slow
def test_straggler_is_dropped_after_client_timeout(ray_local, caplog):
    cfg = tiny_config(algorithm__name="test_slow_client_0", runtime__backend="ray", data__num_clients=3,
                      federation__clients_per_round=3, federation__rounds=1, runtime__client_timeout_s=4)
    with caplog.at_level(logging.WARNING, logger="fedray"):
        out, _ = _run_rounds(cfg, 1)
    assert "dropped client 0: not done within runtime.client_timeout_s=4s" in caplog.text
    # The round closed without the straggler's result (had it waited the 120 s, client 0 would be kept) ...
    assert sorted(out[0][0]) == [1, 2] and out[0][1]["health/dropped_clients"] == 1
    # ... and the run went on: its round was aggregated and the model evaluated after it.
    assert len(out) == 2 and 0.0 <= out[1]["eval/accuracy"] <= 1.0


@pytest.mark.ray
def test_lost_server_actor_stops_the_round_clearly(ray_local):
    from fedray.runtime.ray_runtime import RayRuntime

    cfg = tiny_config(runtime__backend="ray", runtime__server_in_driver=False)
    data = build_federated_data(cfg.data, cfg.seed)
    with RayRuntime(cfg, data) as rt:
        rt.run_round(1, [0, 1, 2])
        assert rt.server_pid != os.getpid()
        os.kill(rt.server_pid, signal.SIGKILL)
        with pytest.raises(RunFailure, match="round 2: the server actor was lost"):
            rt.run_round(2, [0, 1, 2])


class _RemoveNodeDuringRound3(RunHooks):
    """Removes the node once both workers (one a node) hold a client of round 3 (test_held_round), then releases
    them."""

    def __init__(self, cluster, node, gate, runtime):
        self.cluster, self.node, self.gate, self.timer, self.errors = cluster, node, gate, None, []
        self.runtime, self.nodes = runtime, set()

    def _remove(self):
        try:
            self.gate.wait_started(count=2)
            self.cluster.remove_node(self.node)
        except BaseException as e:
            self.errors.append(e)
        finally:
            self.gate.release()

    def on_round(self, row):
        if row["round"] == 1:  # before the removal: one worker on each node (each has one CPU)
            self.nodes = set(self.runtime.pool.nodes)
        if row["round"] == 2:
            self.timer = threading.Thread(target=self._remove)
            self.timer.start()


@pytest.mark.ray
@pytest.mark.slow
def test_a_two_node_cluster_gives_the_local_figures_even_when_a_node_goes(caplog, monkeypatch):
    """A real two-node cluster (ray.cluster_utils.Cluster), a worker on each node; the node is removed in round 3:
    the pool shrinks to the other and the run finishes with the figures of the run in process."""
    import ray
    from ray.cluster_utils import Cluster

    from fedray.runtime import make_runtime

    # The lost node's worker can never restart (the other node's one CPU is taken), so the pool waits the whole
    # READY_TIMEOUT_S (60 s) for it before shrinking; 10 s is ample for the live worker's answer.
    monkeypatch.setattr("fedray.runtime.worker_pool.READY_TIMEOUT_S", 10.0)

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    gate = faulty.Gate(3)
    try:
        node = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
        cfg = _cfg_of_args(runtime__backend="ray", runtime__address=cluster.address, federation__rounds=5,
                           algorithm__name="test_held_round", federation__local_steps=10)
        runtime = make_runtime(cfg)
        hook = _RemoveNodeDuringRound3(cluster, node, gate, runtime)
        with caplog.at_level(logging.WARNING, logger="fedray"):
            result = run_experiment(cfg, progress=False, hooks=[hook], runtime=runtime)
        hook.timer.join()
        assert not hook.errors, hook.errors
    finally:
        gate.close()
        ray.shutdown()
        cluster.shutdown()
    # the lost node's clients rerun on the other from the same seeds: the undisturbed run's figures (this tiny
    # synthetic task sits at chance accuracy on some CPUs, so "it learned" is no check here)
    undisturbed = run_experiment(_cfg_of_args(federation__rounds=5, federation__local_steps=10), progress=False)
    assert result.summary["rounds"] == 5 and len(hook.nodes) == 2
    assert {k: result.summary[k] for k in FIGURES} == pytest.approx({k: undisturbed.summary[k] for k in FIGURES},
                                                                      rel=1e-6)
    assert "the pool shrinks to 1" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_is_finite_finds_a_single_bad_value_in_any_float_tensor_of_an_upload(dtype, bad):
    from fedray.methods.fedavg import ModelUpload
    from fedray.runtime.server_core import is_finite

    weights = {"a": torch.ones(3, 4, dtype=dtype), "b": torch.zeros(7, dtype=dtype), "n": torch.tensor(2)}
    assert is_finite(ModelUpload(weights=weights, num_samples=5))
    weights["b"][5] = bad
    assert not is_finite(ModelUpload(weights=weights, num_samples=5))
    assert not is_finite([{"x": torch.ones(2, requires_grad=True) * bad}])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_is_finite_finds_a_bad_float_among_an_uploads_plain_numbers(bad):
    from fedray.runtime.server_core import is_finite

    assert is_finite({"w": torch.ones(2), "loss": 1.5, "n": 3})
    assert not is_finite({"w": torch.ones(2), "loss": bad, "n": 3})
