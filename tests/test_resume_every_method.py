"""Every built-in method resumes from its checkpoint to the figures of an uninterrupted run: a method whose
server or client state (FedGKD's buffer of past models, FedKF's generators and cache, DaFKD's discriminators,
FedCD's and the isolated baseline's per-client models, an optimizer's moments across rounds) were left out of
its checkpoint would resume to other numbers. A resume may read the data from elsewhere, but not change the
experiment."""

import pytest

from fedray.methods import ALGORITHMS
from fedray.simulation import run_experiment
from tests.methods.test_dafkd import SMALL as DAFKD_SMALL
from tests.conftest import tiny_config

HOLDOUT = {"data__server_data__kind": "holdout", "data__server_data__per_class": 10}
UNLABELLED = {**HOLDOUT, "data__server_data__labelled": False}
CASES = {
    "fedavg": {}, "fedprox": {"algorithm__mu": 0.1}, "qffl": {}, "fedgkd": {}, "local": {}, "fedkf": {},
    "dafkd": DAFKD_SMALL, "fedcd": HOLDOUT, "fedd3a": UNLABELLED, "feddf": UNLABELLED, "feddistill": {},
    # momentum's and Adam's moments, and a learning-rate schedule, carried across the interruption
    "fedavg-momentum": {"federation__momentum": 0.9},
    "fedavg-adam-cosine": {"federation__optimizer": "adam", "federation__lr": 0.01,
                           "federation__lr_schedule": "cosine", "federation__lr_min": 0.001},
}


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


def test_every_built_in_method_has_a_case():
    # (other tests register methods of their own: those live outside fedray.methods)
    built_in = {name for name in ALGORITHMS if ALGORITHMS[name].__module__.startswith("fedray.methods.")}
    assert len(built_in) >= 11 and built_in <= {name.split("-")[0] for name in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_run_interrupted_after_round_2_resumes_to_the_same_figures(case, tmp_path):
    extra = {"algorithm__name": case.split("-")[0], **CASES[case]}
    # with a validation set: val/accuracy is among the figures compared
    cfg = tiny_config(federation__rounds=4, runtime__checkpoint_every=1, data__val_per_class=5, **extra)
    reference = run_experiment(cfg, progress=False)
    with pytest.raises(_Crash):
        run_experiment(cfg, tmp_path / "run", progress=False, hooks=[CrashAfter(2)])
    resumed = run_experiment(cfg, tmp_path / "run", progress=False, resume_from=tmp_path / "run")
    assert [row["round"] for row in resumed.history] == [1, 2, 3, 4]
    keys = [k for k in reference.history[-1] if k.startswith(("eval/", "val/", "server/", "train/", "comm/", "diag/"))]
    assert "val/accuracy" in keys and {k: resumed.history[-1][k] for k in keys} == {k: reference.history[-1][k] for k in keys}


def test_a_resume_may_read_the_data_from_elsewhere_but_not_change_the_experiment(tmp_path):
    from fedray.report.checkpoint import CheckpointError, load_checkpoint
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
