"""Real Fashion-MNIST through torchvision's loader, trained federatedly on real Ray workers by `fedray run` as a user
types it: its result table and nothing of Ray's own, and the in-process runtime's very figures."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from fedray.load import load_config
from fedray.simulation import run_experiment


@pytest.mark.realdata
@pytest.mark.ray
def test_fedavg_on_real_fashion_mnist_with_ray(fashion_mnist_root, tmp_path):
    args = [f"data.data_dir={fashion_mnist_root}", "data.alpha=1.0", "federation.rounds=3",
            "federation.clients_per_round=4", "tracking.enabled=false"]
    done = subprocess.run([sys.executable, "-m", "fedray.cli", "run", "quickstart", *args, "runtime.backend=ray",
                           "--output-dir", str(tmp_path / "out"), "--no-progress"], capture_output=True, text=True,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"}, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == "" and "eval/accuracy" in done.stdout
    for noise in ("pid=", "raylet", "core_worker", "WARNING", "INFO"):
        assert noise not in done.stdout, noise
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["dataset"] == "fashion_mnist" and s["rounds"] == 3 and s["runtime"].startswith("ray:")
    assert s["eval/accuracy"] > 0.3, s  # chance is 0.1; round 3 of this config reaches ~0.36
    assert s["eval/wlp"] <= s["eval/amp"]
    accs = pq.read_table(tmp_path / "out" / "history.parquet")["eval/accuracy"].to_pylist()
    assert accs[-1] > accs[0]
    # the in-process runtime computes the very same numbers on real 1-channel images
    local = run_experiment(load_config("quickstart", args), progress=False)
    for key in ("eval/accuracy", "eval/amp", "eval/fm", "eval/wlp", "comm/bytes_up", "comm/bytes_down"):
        assert local.summary[key] == s[key], key
