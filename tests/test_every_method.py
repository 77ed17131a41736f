"""Every built-in method of the registry (``fedray.methods.ALGORITHMS``), with the settings it needs from ONE place
(``METHOD_CASES`` in tests/conftest.py), on tiny synthetic data:

- **on Ray** every figure of every round is the in-process one (the server in an actor of its own);
- **interrupted** after round 2 and resumed from its checkpoint, the WHOLE history is the uninterrupted run's, in
  process and on Ray (the server in the driver): a state left out of a checkpoint (FedGKD's buffer of past models,
  FedKF's generators and cache, DaFKD's discriminators, FedCD's and the isolated baseline's per-client models, an
  optimizer's moments, a schedule) would resume to other numbers; so is its clients.parquet, row for row;
- **vectorised** clients (``runtime.vectorize=true``) give two rounds' weights and losses of the sequential runner,
  every client in both (its state its own in round 2), to tests/vectorized's tolerance, for every method whose
  clients return a training plan, several clients to each batched call.

A built-in method without a case fails here, saying what to add where. A resume may read the data from elsewhere,
but not change the experiment.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import math
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedray.data import build_federated_data
from fedray.record.run_dir import CLIENT_HISTORY_FILE
from fedray.simulation import run_experiment
from tests.conftest import LEARNABLE, METHOD_CASES, built_in_methods, method_overrides, tiny_config
from tests.vectorized.test_vectorized import _max_relative_difference, _one_round, float64_runs

ROUNDS, CRASH_AFTER = 3, 2
# every case of METHOD_CASES, and every built-in method (one without a case fails, naming what to add)
CASES = sorted(set(built_in_methods()) | set(METHOD_CASES))
# on Ray: one method for each kind of state a round moves between processes (the state the workers keep, what the
# server keeps, what crosses the object store), so that a kind Ray mishandles shows; the others reach Ray through the
# same code with state of a kind listed here (every method runs each in-process check above):
# - fedavg: the global model alone (FedProx, q-FFL and FedAvg's optimizer variants: the same messages and state);
# - scaffold: a control variate per client; fedcd: per-client models of two architectures and logits on the
#   server's images (the isolated baseline's and FedDistill's own models; resumed after a SIGKILL in
#   tests/test_reliability.py too); dafkd: per-client discriminators and a generator (its private variant: more of it);
# - fedkf: a cache of every client's last upload (FedGKD's buffer of past models); fedgen: a generator the server
#   trains (FedFTG's); fedd3a: distillation on the server's unlabelled data (FedDF's);
# - fedavg-system and fedavg-async: the simulated clock, availability and clients in flight at a checkpoint.
# the methods that keep state of their own between rounds beyond the global model (client states, generators,
# caches, discriminators, flights, the clock): their Ray checkpoints must hold it all
RAY_CASES = ["dafkd", "fedavg-async", "fedavg-system", "fedcd", "fedd3a", "fedgen", "fedkf", "scaffold"]
# resumed on Ray too (a checkpoint loaded back into Ray's actors: the largest server state, and the clock); the
# others resume in process from their Ray checkpoint, which shows it holds the whole state at the cost of no actor
RESUMED_ON_RAY = ("dafkd", "fedavg-system")
# methods whose clients return a finished ClientResult, not a training plan: never batched (name -> why)
SEQUENTIAL_ONLY: dict[str, str] = {}


class _Crash(Exception):
    pass


class CrashAfter:
    """A hook that stops the run after round ``n``'s checkpoint, like a kill between rounds."""

    def __init__(self, n: int):
        self.n = n

    def on_start(self, cfg, data):
        pass

    def on_round(self, row):
        if row["round"] == self.n:
            raise _Crash

    def on_end(self, result):
        pass

    def on_error(self, exc):
        pass


def _config(case: str, **overrides):
    """The case on the learnable synthetic task (LEARNABLE, under the case's own settings), with a validation set:
    val/accuracy is among the figures compared."""
    learnable = {k.replace(".", "__"): v for k, v in LEARNABLE.items()}
    return tiny_config(**{**learnable, **method_overrides(case), "federation__rounds": ROUNDS,
                          "data__val_per_class": 5, **overrides})


_DATA: dict[str, object] = {}
_REFERENCE: dict[str, "_Run"] = {}
# The reference runs' folders (their clients.parquet and figures): one place for the whole test session, shared by
# the xdist workers (the _shared_references fixture), so that a case's reference is run once, not once per worker
# that runs one of its tests. Outside xdist (or before the fixture), a folder of this process's own.
_REFERENCE_DIRS = Path(tempfile.mkdtemp(prefix="fedray-test-reference-"))
atexit.register(shutil.rmtree, _REFERENCE_DIRS, True)


@pytest.fixture(scope="module", autouse=True)
def _shared_references(tmp_path_factory):
    """Under xdist, the reference runs go to the session's shared temporary folder (the parent of each worker's
    own), where pytest cleans them up with the session's other folders."""
    global _REFERENCE_DIRS
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _REFERENCE_DIRS = tmp_path_factory.getbasetemp().parent / "every-method-references"
        _REFERENCE_DIRS.mkdir(exist_ok=True)


@contextlib.contextmanager
def _locked(path: Path):
    """Held by one process at a time (the xdist workers' reference runs)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _data(case: str):
    """One tiny dataset per data setting, shared by every run of the module (the runs never change it)."""
    cfg = _config(case)
    key = cfg.data.model_dump_json() + f"/{cfg.seed}"
    if key not in _DATA:
        _DATA[key] = build_federated_data(cfg.data, cfg.seed)
    return _DATA[key]


def _figures(history: list[dict]) -> list[dict]:
    """Every figure of every round but the wall times; NaN made comparable. Ray's count of dropped clients (absent
    in process) must be 0."""
    assert all(row.get("health/dropped_clients", 0.0) == 0.0 for row in history)
    return [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()
             if not k.startswith("time/") and k != "health/dropped_clients"} for row in history]


def _summary(result) -> dict:
    """The run's final figures (summary.json's): the last evaluation, the best, communication totals, rounds."""
    figures = _figures([result.summary])[0]
    return {k: v for k, v in figures.items() if k.startswith(("eval/", "val/", "comm/", "rounds"))}


@dataclass
class _Run:
    history: list[dict]
    summary: dict
    clients: pa.Table  # clients.parquet


def _clients(folder: Path) -> pa.Table:
    return pq.read_table(folder / CLIENT_HISTORY_FILE)


def _reference(case: str) -> _Run:
    """The uninterrupted in-process run's figures, computed once per case in the session (the first xdist worker to
    need them runs it and saves its figures beside its run folder; the others read them)."""
    if case not in _REFERENCE:
        folder, figures = _REFERENCE_DIRS / case, _REFERENCE_DIRS / f"{case}.figures.pkl"
        with _locked(_REFERENCE_DIRS / f"{case}.lock"):
            if not figures.exists():
                result = run_experiment(_config(case), folder, progress=False, data=_data(case))
                assert [row["round"] for row in result.history] == list(range(1, ROUNDS + 1))
                assert "val/accuracy" in result.history[-1] and "eval/accuracy" in result.history[-1]
                partial = figures.with_suffix(".partial")
                partial.write_bytes(pickle.dumps((_figures(result.history), _summary(result))))
                partial.rename(figures)
            history, summary = pickle.loads(figures.read_bytes())
        _REFERENCE[case] = _Run(history, summary, _clients(folder))
    return _REFERENCE[case]


def test_every_built_in_method_has_a_case():
    built_in = built_in_methods()
    assert len(built_in) >= 11, built_in
    missing = [name for name in built_in if name not in METHOD_CASES]
    assert not missing, (f"built-in methods without a case: {missing}; add each to METHOD_CASES in tests/conftest.py "
                         "with the settings it needs to run on tiny_config's synthetic data ({} if none)")
    assert {case.split("-")[0] for case in METHOD_CASES} <= set(built_in)


# On the learnable task every method ends its 3 rounds of 8 steps well above chance (0.1 over 10 classes): a
# method whose loss or aggregation is broken ends at chance, as every run did on the hard synthetic task.
LEARNS_ABOVE = 0.25
# A method's mechanism, read off its last round where the tiny task lets it work (case -> (key, floor, why)).
MECHANISMS: dict[str, list[tuple[str, float, str]]] = {
    "dafkd": [("train/disc_acc_real", 0.5, "the discriminators read real images as real (Eq. 2)"),
              ("diag/ens_acc_eq7", LEARNS_ABOVE, "Eq. 7's weighted ensemble reads real test images")],
    "dafkd-private": [("train/disc_acc_real", 0.5, "each client's discriminator reads real images as real")],
    "fedavg-fltrust": [("agg/fltrust_mean_trust", 0.1, "honest clients' updates point where the server's own does")],
    "fedcd": [("server/teacher_acc", LEARNS_ABOVE, "Eq. 4's teacher reads the server's images")],
    "fedd3a": [("diag/teacher_acc_soft", LEARNS_ABOVE, "Eq. 7's teacher reads the server's images"),
               ("diag/student_acc", LEARNS_ABOVE, "the distilled student reads them too")],
    "fedd3a-heterogeneous": [("diag/teacher_acc_soft", LEARNS_ABOVE, "Eq. 7's teacher of two architectures")],
    "feddf": [("diag/teacher_acc", LEARNS_ABOVE, "the averaged-logit teacher reads the server's images")],
    "fedftg": [("server/gen_acc_teachers", LEARNS_ABOVE, "the teachers read the generator's samples as their class")],
    "fedkf": [("eval/accuracy_oca", LEARNS_ABOVE, "the cached aggregate (the teacher) reads the test set")],
}
# ... and figures that must stay below a ceiling (case -> (key, ceiling, why)). DaFKD's Eq. 7 entropy is not among
# them: its discriminators do not tell the clients' domains apart in 3 rounds here (diag/domain_auc ~0.5, entropy
# ~0.997), the finding docs/reproducing.md reports on real data too.
MECHANISM_CEILINGS: dict[str, list[tuple[str, float, str]]] = {
    "fedd3a": [("server/alpha_entropy", 0.95, "Eq. 6's weights tell the clients apart (1 = uniform)")],
    "fedkf": [("train/l_ie", 0.1, "L_IE: the generator's samples spread over the classes (0 = uniform)")],
}


@pytest.mark.parametrize("case", CASES)
def test_every_method_learns_the_synthetic_task(case):
    """Its uninterrupted run ends above chance by a clear margin, and its mechanism's figures say it works; what it
    learned crossed the wire (the isolated baseline sends nothing)."""
    last = _reference(case).history[-1]
    sent = _reference(case).summary["comm/bytes_up"], _reference(case).summary["comm/bytes_down"]
    assert (sent == (0, 0)) if case == "local" else min(sent) > 0, sent
    assert last["eval/accuracy"] >= LEARNS_ABOVE, (
        f"{case} ends its {ROUNDS} rounds at eval/accuracy {last['eval/accuracy']:.3f} on the learnable synthetic "
        f"task (chance 0.1); every method should reach {LEARNS_ABOVE}")
    for key, floor, why in MECHANISMS.get(case, []):
        assert last[key] >= floor, f"{case}: {key} = {last[key]:.3f} < {floor}: {why}"
    for key, ceiling, why in MECHANISM_CEILINGS.get(case, []):
        assert last[key] <= ceiling, f"{case}: {key} = {last[key]:.3f} > {ceiling}: {why}"


@pytest.mark.parametrize("case", CASES)
def test_an_interrupted_run_resumes_to_the_whole_uninterrupted_history(case, tmp_path):
    cfg = _config(case, runtime__checkpoint_every=1)
    with pytest.raises(_Crash):
        run_experiment(cfg, tmp_path / "run", progress=False, hooks=[CrashAfter(CRASH_AFTER)], data=_data(case))
    resumed = run_experiment(cfg, tmp_path / "run", progress=False, resume_from=tmp_path / "run", data=_data(case))
    assert _figures(resumed.history) == _reference(case).history
    assert _summary(resumed) == _reference(case).summary
    assert _clients(tmp_path / "run").equals(_reference(case).clients)


@pytest.mark.ray
@pytest.mark.parametrize("case", RAY_CASES)
def test_on_ray_every_round_and_a_resume_give_the_in_process_history(case, ray_local, tmp_path):
    """Rounds 1-2 on Ray, two workers and the server in an actor of its own (its state, its server data and the
    uploads cross the object store), interrupted after round 2's checkpoint; round 3 resumed from that checkpoint, on
    Ray with one fresh worker and the server in the driver (the default without server resources) for the methods of
    ``RESUMED_ON_RAY``, in process for the others. Every figure of every round is the in-process uninterrupted run's:
    rounds 1-2 say Ray computes what the process does, round 3 that a checkpoint written on Ray holds all the state
    (and loads back into Ray). (An actor's start costs ~2 s of CPU, the suite's largest cost: three actors a case,
    four where resumed on Ray.) Its clients.parquet is the in-process one, row for row."""
    first = _config(case, runtime__backend="ray", runtime__server_in_driver=False, runtime__checkpoint_every=1)
    with pytest.raises(_Crash):
        run_experiment(first, tmp_path / "run", progress=False, hooks=[CrashAfter(CRASH_AFTER)], data=_data(case))
    on_ray = case in RESUMED_ON_RAY
    cfg = _config(case, runtime__checkpoint_every=1,
                  **({"runtime__backend": "ray", "runtime__num_workers": 1} if on_ray else {}))
    resumed = run_experiment(cfg, tmp_path / "run", progress=False, resume_from=tmp_path / "run", data=_data(case))
    if on_ray:
        assert resumed.summary["runtime"].startswith("ray: 1 client worker(s)"), resumed.summary["runtime"]
        assert "server in the driver" in resumed.summary["runtime"], resumed.summary["runtime"]
    got, want = _figures(resumed.history), _reference(case).history
    assert got[:CRASH_AFTER] == want[:CRASH_AFTER], "on Ray the rounds differ from in-process"
    assert got[CRASH_AFTER:] == want[CRASH_AFTER:], "resumed on Ray from a Ray checkpoint, the rounds differ"
    assert _summary(resumed) == _reference(case).summary
    assert _clients(tmp_path / "run").equals(_reference(case).clients), "clients.parquet differs from in-process"


def assert_batched(case: str, infos: list[dict]) -> None:
    """Every client of the round went through the batched engine, several clients to a vmapped call."""
    assert all("vec/groups_per_step" in info for info in infos), (
        f"{case}'s clients were not batched: a method whose client_update returns a finished ClientResult goes "
        "in SEQUENTIAL_ONLY in tests/test_every_method.py, with the reason")
    per_call = [info["vec/clients_per_call"] for info in infos]
    assert min(per_call) > 1.0, (
        f"{case}: a vmapped call trained {min(per_call)} client(s) on average: its plans do not share a group "
        "(LocalTraining/StepwiseTraining.group must be the same for clients whose losses are the same)")


# two rounds of every client: in round 2 each client's state (a control variate, a discriminator, a generator, its
# own model) is its own and not the initial one, so a loss that read one client's state for all would show
VECTORISED = {"federation__clients_per_round": 6}


@pytest.mark.parametrize("case", CASES)
def test_vectorised_clients_give_the_sequential_rounds(case, monkeypatch):
    """In float64, where the batched and the sequential rounding stay ~1e-15 apart over two rounds (in float32 a
    BatchNorm or Adam step amplifies them past 1e-4 in round 2, the size of a small real error)."""
    kw = {**method_overrides(case), **VECTORISED}
    if kw["algorithm__name"] == "dafkd":
        kw["algorithm__diag_samples"] = 0  # its probe holds float32 images
    with float64_runs(monkeypatch):
        seq_w, seq_info = _one_round(False, rounds=2, **kw)
        vec_w, vec_info = _one_round(True, rounds=2, **kw)
    if kw["algorithm__name"] in SEQUENTIAL_ONLY:
        assert not any("vec/groups_per_step" in info for info in vec_info)
    else:
        assert_batched(case, vec_info)
    for c in seq_w:
        assert _max_relative_difference(seq_w[c], vec_w[c]) < 1e-9, c
    for s, v in zip(seq_info, vec_info, strict=True):
        assert s["client"] == v["client"] and s["bytes_up"] == v["bytes_up"]
        assert v["train/loss"] == pytest.approx(s["train/loss"], rel=1e-9)


def test_the_batching_check_fails_plans_of_one_group_per_client(monkeypatch):
    """FedAvg's plans made one group per client are never batched: each vmapped call trains one client. The step
    figure cannot tell (every step is still one call, ``vec/groups_per_step`` 1.0); ``vec/clients_per_call`` can,
    and :func:`assert_batched` fails on it."""
    from fedray.methods.fedavg import FedAvg

    planned = FedAvg.client_update
    monkeypatch.setattr(FedAvg, "client_update", lambda self, ctx, payload, state: dataclasses.replace(
        planned(self, ctx, payload, state), group=ctx.client_id))
    _, infos = _one_round(True, **method_overrides("fedavg"))
    assert [i["vec/groups_per_step"] for i in infos] == [1.0] * 3
    assert [i["vec/clients_per_call"] for i in infos] == [1.0] * 3
    with pytest.raises(AssertionError, match="do not share a group"):
        assert_batched("fedavg", infos)


def test_a_resume_may_read_the_data_from_elsewhere_but_not_change_the_experiment(tmp_path):
    from fedray.record.checkpoint import CheckpointError, load_checkpoint
    from fedray.simulation import check_resumable

    cfg = tiny_config(federation__rounds=3, runtime__checkpoint_every=1)
    with pytest.raises(_Crash):
        run_experiment(cfg, tmp_path / "run", progress=False, hooks=[CrashAfter(1)])
    ckpt = load_checkpoint(tmp_path / "run")
    # the dataset moved, or another machine: the same experiment
    check_resumable(cfg.model_copy(update={"data": cfg.data.model_copy(update={
        "data_dir": str(tmp_path), "cache_dir": str(tmp_path / "moved"), "download": False, "cache": False})}), ckpt)
    with pytest.raises(CheckpointError, match="data.alpha"):
        check_resumable(cfg.model_copy(update={"data": cfg.data.model_copy(update={"alpha": 0.3})}), ckpt)
