"""A corpus of user mistakes: each ends with exit status 2 and one line on stderr naming the field and what
is allowed, before any work: no traceback, no output directory, no MLflow run."""

import subprocess
import sys

import pytest
import torch
from mlflow.tracking import MlflowClient

from fedray.cli import main

RUN = ["run", "synthetic", "data.num_clients=6", "federation.clients_per_round=3", "federation.rounds=1",
       "federation.local_steps=1", "data.synthetic_train_samples=600", "--output-dir", "out", "--no-progress"]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="asking for a GPU is not an error on a GPU machine")

CASES = [
    # (extra argv for `run`, or a full argv starting with a command), key, a fragment of the message
    (["data.alpha=0"], "data.alpha", "greater than 0"),
    (["data.partition=on_demand", "privacy.mia_samples=10"], "privacy.mia_samples", "would make every client"),
    (["data.partition=on_demand", "algorithm.name=fedkf", "aggregation.rule=median"], "aggregation.rule",
     "a vote per registered client"),
    (["data.pseudo_base_clients=9"], "data.pseudo_base_clients", "allowed: 1..data.num_clients"),
    (["data.pseudo_base_clients=2", "data.partition=on_demand"], "data.pseudo_base_clients", "use dirichlet"),
    (["data.alpha=-1"], "data.alpha", "greater than 0"),
    (["data.alpha=abc"], "data.alpha", "valid number"),
    (["data.num_clients=0"], "data.num_clients", "greater than or equal to 1"),
    (["data.min_samples=1"], "data.min_samples", "greater than or equal to 2"),
    (["data.partition=random"], "data.partition", "'dirichlet', 'iid', 'shards', 'domain', 'domain_dirichlet', 'central' or 'on_demand'"),
    (["data.dataset=imagenet"], "data.dataset", "'fashion_mnist'"),
    (["data.test_fraction=1.5"], "data.test_fraction", "less than 1"),
    (["data.dataset=fashion_mnist", "data.data_dir=/no/such/dir"], "data.data_dir", "--data-dir"),
    (["data.emnist_split=greek"], "data.emnist_split", "'balanced'"),
    (["data.min_samples=100000"], "data.min_samples", "lower data.min_samples"),
    (["data.partition=shards", "data.shards_per_client=100000"], "data.shards_per_client", ""),
    (["model.name=vgg"], "model.name", "allowed: lenet5, resnet8, resnet11, mlp"),
    (["algorithm.name=fedfoo"], "algorithm.name", "allowed: "),
    (["algorithm.mu=0.1"], "algorithm.mu", "not a parameter of 'fedavg'"),
    (["algorithm.name=fedprox", "algorithm.mu=-1"], "algorithm.mu", "greater than or equal to 0"),
    (["algorithm.name=fedprox", "algorithm.mux=1"], "algorithm.mux", "algorithm.mu"),
    (["federation.rounds=0"], "federation.rounds", "greater than or equal to 1"),
    (["federation.mode=semi_sync"], "federation.mode", "allowed: sync, async"),
    (["channel.precision=fp8"], "channel.precision", "'fp32', 'fp16' or 'bf16'"),
    (["channel.compress=topk"], "channel.compress", "allowed keys here: precision"),
    (["adversary.attack=lies", "adversary.fraction=0.2"], "adversary.attack", "'lie'"),
    (["adversary.attack=sign_flip", "adversary.fraction=0.2", "adversary.target=3"], "adversary.target",
     "only read with adversary.attack=backdoor"),
    (["adversary.attack=lie", "adversary.clients=[0,9]"], "adversary.clients", "allowed: 0..5"),
    (["aggregation.rule=krum", "aggregation.f=2"], "aggregation.f", "Krum needs 2f + 2 < n"),
    (["aggregation.rule=fltrust"], "data.server_data.kind", "a labelled root dataset"),
    (["privacy.mechanism=secure"], "privacy.mechanism", "'none', 'central' or 'local'"),
    (["privacy.clip=0.5"], "privacy.clip", "only read with privacy.mechanism=central or local"),
    (["privacy.mechanism=central", "privacy.clip=0"], "privacy.clip", "greater than 0"),
    (["privacy.mechanism=local", "privacy.delta=1"], "privacy.delta", "less than 1"),
    (["privacy.mechanism=local", "privacy.noise_multiplier=-1"], "privacy.noise_multiplier", "allowed: >= 0, or auto"),
    (["privacy.sample_noise=2"], "privacy.sample_noise", "only read with privacy.sample_clip"),
    (["privacy.sample_batches=poisson"], "privacy.sample_batches", "only read with privacy.sample_clip"),
    (["privacy.histogram_clip=5"], "privacy.histogram_clip", "only read with privacy.mechanism=local"),
    (["privacy.mechanism=local", "algorithm.name=feddistill", "privacy.histogram_noise=0.5"],
     "privacy.histogram_noise", "raise privacy.histogram_noise"),
    (["algorithm.name=dafkd", "algorithm.gp_weight=10", "privacy.sample_clip=1"], "algorithm.gp_weight",
     "drop privacy.sample_clip"),
    (["privacy.mechanism=central", "aggregation.rule=median"], "privacy.mechanism", "aggregation.rule=mean"),
    (["privacy.mechanism=central", "privacy.target_epsilon=0.5"], "privacy.target_epsilon", "first round already"),
    (["privacy.mechanism=central", "algorithm.name=scaffold"], "privacy.mechanism", "privacy.mechanism=local"),
    (["federation.clients_per_round=50"], "federation.clients_per_round", "allowed: 1..6"),
    (["federation.local_steps=-3"], "federation.local_steps", "greater than or equal to 1"),
    (["federation.batch_size=0"], "federation.batch_size", "greater than or equal to 1"),
    (["federation.lr=0"], "federation.lr", "greater than 0"),
    (["federation.optimizer=rmsprop"], "federation.optimizer", "'sgd' or 'adam'"),
    (["federation.momentum=1.5"], "federation.momentum", "less than 1"),
    (["federation.eval_every=0"], "federation.eval_every", "greater than or equal to 1"),
    (["runtime.backend=spark"], "runtime.backend", "'local' or 'ray'"),
    (["runtime.num_workers=100"], "runtime.num_workers", "allowed: 1..6"),
    pytest.param(["runtime.num_gpus_per_worker=1"], "runtime.num_gpus_per_worker", "none is visible", marks=NO_GPU),
    (["runtime.num_gpus_per_worker=-1"], "runtime.num_gpus_per_worker", "greater than or equal to 0"),
    pytest.param(["runtime.device=cuda"], "runtime.device", "runtime.device=cpu", marks=NO_GPU),
    (["runtime.num_cpus_per_worker=0"], "runtime.num_cpus_per_worker", "greater than 0"),
    (["runtime.checkpoint_every=-1"], "runtime.checkpoint_every", "greater than or equal to 0"),
    (["runtime.client_timeout_s=0"], "runtime.client_timeout_s", "greater than 0"),
    (["runtime.max_client_retries=-2"], "runtime.max_client_retries", "greater than or equal to 0"),
    (["tracking.uri=nosuch://x"], "tracking.uri", "tracking.enabled=false"),
    (["tracking.experiment="], "tracking.experiment", "string"),
    (["colour=blue"], "colour", "allowed keys here: name, seed, data"),
    (["data.alpah=1"], "data.alpah", "allowed keys here: dataset"),
    (["federation.rounds"], "federation.rounds", "key=value"),
    (["seed=abc"], "seed", "valid integer"),
    (["seed=-1"], "seed", "greater than or equal to 0"),
    (["seed=4294967296"], "seed", "less than or equal to 4294967295"),
    (["run", "no_such_preset"], "config", "presets: "),
    (["run", "--resume", "nowhere"], "--resume", "no checkpoint"),
    (["partition", "synthetic", "data.partition=iid", "data.num_clients=3000", "federation.clients_per_round=2",
      "data.synthetic_train_samples=1000"], "data.num_clients", ""),
    (["tune", "missing_spec.yaml"], "SPEC", "does not exist"),
    (["tune", "tune_configs/smoke.yaml", "--num-samples", "0"], "--num-samples", "at least 1"),
    (["tune", "tune_configs/smoke.yaml", "--num-samples", "3"], "--num-samples", "run identical trials"),
    (["report", "no/such/run"], "RUNS", ""),
    # per-client models, server data and domains
    (["model.client_models=[lenet5,resnet8]"], "model.client_models", "use a method with per-client models"),
    (["algorithm.name=local", "model.client_models=[lenet5,vgg]"], "model.client_models", "allowed: lenet5"),
    (["data.domains=[original]"], "data.domains", "has no domains"),
    (["data.partition=domain"], "data.partition", "needs a multi-domain data.dataset"),
    (["data.server_data.kind=domain"], "data.server_data.kind", "use kind=holdout"),
    (["data.dataset=fmnist_domains", "data.server_data.kind=domain", "data.server_data.domain=sepia"],
     "data.server_data.domain", "allowed: original"),
    (["data.dataset=fmnist_domains", "data.domains=[original,original]"], "data.domains", "distinct"),
    (["data.dataset=fmnist_domains", "data.domains=[noisy]", "data.server_data.kind=domain"], "data.domains",
     "at least two domains"),
    (["data.server_data.kind=holdout", "data.server_data.per_class=1000"], "data.server_data.per_class", ""),
]


def _argv(extra):
    return extra if extra[0] in ("run", "partition", "tune", "report") else RUN + extra


@pytest.mark.parametrize("extra, key, fragment", CASES)
def test_bad_input(extra, key, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if extra[:2] == ["tune", "tune_configs/smoke.yaml"]:
        from pathlib import Path

        extra = ["tune", str(Path(__file__).parents[1] / "tune_configs" / "smoke.yaml"), *extra[2:]]
    assert main(_argv(extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {key}"), err[0]
    assert fragment in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
    if (tmp_path / "mlflow.db").exists():  # a store may be opened to check tracking.uri, never a run
        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        assert all(not client.search_runs([e.experiment_id]) for e in client.search_experiments())


def test_corpus_is_large_enough():
    assert len(CASES) >= 30


def test_bad_yaml_files(tmp_path, capsys):
    (tmp_path / "broken.yaml").write_text("data: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert main(["run", str(tmp_path / "broken.yaml")]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "list.yaml")]) == 2
    assert "must hold a mapping" in capsys.readouterr().err


def test_output_paths_that_cannot_be_written_are_refused_before_work(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(RUN[:-3] + ["--output-dir", str(tmp_path / "afile")]) == 2
    assert capsys.readouterr().err.startswith("error: --output-dir")
    # a folder under a file cannot be made: said before the data load and before any MLflow run
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(RUN[:-3] + ["--output-dir", str(tmp_path / "afile" / "run")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()
    # likewise the files partition and report write, before their work
    for argv, option in [(["partition", "synthetic", "--plot", "afile/p.png"], "--plot"),
                         (["report", str(tmp_path), "--out", "afile/t.md"], "--out"),
                         (["report", str(tmp_path), "--plot", str(tmp_path)], "--plot"),
                         (["report", str(tmp_path), "--plot", "curves.txt"], "--plot"),
                         (["partition", "synthetic", "--plot", "p.xyz"], "--plot")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {option}: ") and ("directory" in err or "no image format" in err), err


@pytest.mark.parametrize("bad", [  # the first two start a local Ray in the process (ray)
    pytest.param("runtime.num_cpus_per_worker=64", marks=pytest.mark.ray),  # found once Ray is up (its resources)
    pytest.param("algorithm.name=nope", marks=pytest.mark.ray),  # found while Ray starts (registries load meanwhile)
    "runtime.address=garbage",  # refused by ray.init
    "runtime.address=127.0.0.1:1",  # nothing listens: at once, where ray.init would wait minutes
])
def test_no_traceback_from_a_real_process(tmp_path, bad):
    """The console script itself: exit 2, one line, no traceback, for a bad request on Ray."""
    proc = subprocess.run([sys.executable, "-m", "fedray.cli", *RUN, "runtime.backend=ray", bad],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "RAY_AUTH_MODE": "disabled", "HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: {bad.split('=')[0]}") and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_user_errors_survive_pickling_as_ray_reports_them():
    """A trial's or a Ray task's error reaches the driver pickled: it must keep its field and message."""
    import pickle

    from fedray.errors import ConfigError, DataError, ResourceError

    for cls in (ConfigError, DataError, ResourceError):
        back = pickle.loads(pickle.dumps(cls("data.min_samples", "too large for 6 clients")))
        assert type(back) is cls and back.key == "data.min_samples" and back.message == "too large for 6 clients"
        assert str(back) == "data.min_samples: too large for 6 clients"
