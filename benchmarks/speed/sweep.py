"""Time a 4-trial sweep end to end (`fedray tune tune_configs/smoke.yaml`) and check what MLflow holds.

    .venv/bin/python benchmarks/speed/sweep.py [--out benchmarks/results]

Target (issue 3): under 2 minutes on a 2-core machine, 1 parent and 4 FINISHED children, each with
eval/accuracy and the sweep's metric, val/accuracy, at steps 1..3. Runs in a temporary directory (its own
mlflow.db and sweep state).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fedray.cli", "tune", str(ROOT / "tune_configs" / "smoke.yaml"), "--name", "bench"]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            sys.exit(f"sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        client = MlflowClient(f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        exp = client.get_experiment_by_name("smoke")
        runs = client.search_runs([exp.experiment_id])
        kids = [r for r in runs if r.data.tags.get("fedray.kind") == "trial"]
        record = {
            "benchmark": "sweep", "date": time.strftime("%Y-%m-%d %H:%M"), "command": "fedray tune tune_configs/smoke.yaml",
            "machine": {"cpus": os.cpu_count(), "device": "cpu"},
            "wall_s": round(wall, 1), "target_s": 120, "target_met": wall < 120,
            "parents": sum(r.data.tags.get("fedray.kind") == "sweep" for r in runs),
            "children": len(kids), "children_finished": sum(k.info.status == "FINISHED" for k in kids),
            "eval_steps": sorted({tuple(m.step for m in client.get_metric_history(k.info.run_id, key))
                                  for k in kids for key in ("eval/accuracy", "val/accuracy")}),
            "best": json.loads((Path(tmp) / "runs" / "tune" / "bench" / "best.json").read_text()),
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "best"}, indent=2))


if __name__ == "__main__":
    main()
