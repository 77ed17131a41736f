"""The command line: results written, and every user mistake ends in one line naming the key, exit 2."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from fedray.cli import main

TINY_ARGS = ["synthetic", "data.num_clients=6", "federation.clients_per_round=3", "federation.rounds=3",
             "federation.local_steps=3", "data.synthetic_train_samples=600", "data.synthetic_test_samples=200",
             "federation.eval_every=2", "tracking.enabled=false"]


def test_run_writes_summary_and_history(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", *TINY_ARGS, "--output-dir", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval/accuracy", "eval/amp", "eval/fm", "eval/wlp", "comm/bytes_up", "comm/bytes_down"):
        assert isinstance(summary[key], float)
    assert 0 <= summary["eval/accuracy"] <= 1 and summary["rounds"] == 3
    rows = pq.read_table(out / "history.parquet").to_pylist()
    assert [r["round"] for r in rows] == [1, 2, 3]
    # eval_every=2: round 2 and the last round are evaluated; round 1 leaves eval columns empty
    assert [r["eval/accuracy"] is None for r in rows] == [True, False, False]
    assert all(r["comm/bytes_up"] > 0 and r["time/round_s"] > 0 for r in rows)
    # where a round's time went: the server's aggregation, and the evaluation where there was one
    assert [r["time/eval_s"] > 0 for r in rows] == [False, True, True]
    assert all(0 < r["time/server_s"] and r["time/server_s"] + r["time/eval_s"] < r["time/round_s"] for r in rows)
    assert sum(r["comm/bytes_up"] for r in rows) == summary["comm/bytes_up"]
    assert (out / "config.yaml").exists() and (out / "model.pt").exists()
    assert "eval/accuracy" in capsys.readouterr().out  # the final table


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch, capsys):
    """Seeds launched together used to share runs/NAME-TIME: each replaced the other's files, both said done."""
    monkeypatch.chdir(tmp_path)
    import time

    real = time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, *t: "20261128-120000" if fmt == "%Y%m%d-%H%M%S" else real(fmt, *t))
    for seed in (1, 2):
        assert main(["run", *TINY_ARGS, f"seed={seed}", "--no-progress"]) == 0
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == ["synthetic-20261128-120000", "synthetic-20261128-120000-2"]
    seeds = [json.loads((tmp_path / "runs" / r / "summary.json").read_text())["seed"] for r in runs]
    assert seeds == [1, 2]
    for bad in ("algorithm.name=nope", "runtime.device=cuda"):  # refused after the folder was made: removed again
        assert main(["run", *TINY_ARGS, bad, "--no-progress"]) == 2
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == runs


def test_a_run_folder_in_use_is_refused_and_left_as_it_was(tmp_path, capsys):
    from fedray.record.run_dir import LOCK_FILE, claim_run_dir

    out = tmp_path / "out"
    with claim_run_dir(out):  # another run writing there (a second open file description: flock conflicts)
        (out / "checkpoint.pt").write_bytes(b"theirs")
        assert main(["run", *TINY_ARGS, "--output-dir", str(out), "--no-progress"]) == 2
        assert f"{out} is in use by another fedray run (pid {os.getpid()})" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, "checkpoint.pt"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt"]  # the lock file goes with the claim
    with claim_run_dir(tmp_path / "empty"):
        pass
    assert not (tmp_path / "empty").exists()  # a folder the claim made and nothing used is removed


BAD = [
    (["data.alpha=0"], "data.alpha"),
    (["data.alpha=-0.5"], "data.alpha"),
    (["data.alpha=abc"], "data.alpha"),
    (["federation.clients_per_round=7"], "federation.clients_per_round"),
    (["algorithm.name=nope"], "algorithm.name"),
    (["model.name=nope"], "model.name"),
    (["data.dataset=nope"], "data.dataset"),
    (["data.partition=nope"], "data.partition"),
    (["algorithm.mu=1"], "algorithm.mu"),
    (["federation.rounds=x"], "federation.rounds"),
    (["data.dataset=fashion_mnist", "data.data_dir=/no/such/dir"], "data.data_dir"),
    (["runtime.num_gpus_per_worker=1"], "runtime.num_gpus_per_worker"),
    (["runtime.device=cuda"], "runtime.device"),
    (["colour=blue"], "colour"),
    (["federation.rounds"], "federation.rounds"),
]


@pytest.mark.parametrize("extra, key", BAD, ids=[b[1] + ":" + b[0][0] for b in BAD])
def test_bad_input_is_one_line_naming_the_key(extra, key, tmp_path, capsys):
    if "gpu" in extra[0] or "cuda" in extra[0]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU, so asking for one is not an error here")
    out = tmp_path / "out"
    code = main(["run", *TINY_ARGS, *extra, "--output-dir", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: {key}"), err
    assert not out.exists(), "nothing may be written for bad input"


def test_unknown_preset_lists_the_presets(capsys):
    assert main(["run", "nosuch"]) == 2
    assert "quickstart" in capsys.readouterr().err


@pytest.mark.ray
def test_missing_gpu_on_ray_is_refused_before_work(tmp_path, capsys, ray_local):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    code = main(["run", *TINY_ARGS, "runtime.backend=ray", "runtime.num_gpus_per_worker=0.5",
                 "--output-dir", str(out), "--no-progress"])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: runtime.num_gpus_per_worker")
    assert not out.exists()


def test_console_script_exit_status_and_no_traceback(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    bad = subprocess.run([sys.executable, "-m", "fedray.cli", "run", "quickstart", "data.alpha=-1"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: data.alpha: Input should be greater than 0 (got -1)"
    ]
    assert not (tmp_path / "runs").exists()
    usage = subprocess.run([sys.executable, "-m", "fedray.cli", "run"], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "Traceback" not in usage.stderr


def test_partition_prints_counts_and_plots(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert main(["partition", "synthetic", "data.num_clients=5", "federation.clients_per_round=2",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "client" in out and png.stat().st_size > 1000


def test_models_lists_the_zoo_for_a_dataset(capsys):
    from fedray.models import MODEL_NAMES

    assert main(["models", "--dataset", "cifar100"]) == 0
    out = capsys.readouterr().out
    assert "3x32x32 images, 100 classes" in out
    assert all(name in out for name in MODEL_NAMES)
    assert "11,220,132" in out  # resnet18: 11,173,962 with 10 classes, + 90 x (512 + 1) for 100
    assert main(["models", "synthetic", "data.synthetic_image_size=8"]) == 0
    assert "needs images of at least 12x12" in capsys.readouterr().out  # lenet5 cannot take 8x8
