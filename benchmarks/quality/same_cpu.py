"""Was a committed benchmark run made on a CPU that rounds as this one does? Its first ``--check-rounds`` rounds,
rerun here from the benchmark's own config, compared bit for bit with its ``history.parquet``.

A run folder's ``machine.json`` names its CPU; runs recorded before it carried the family, model and vector width
(``harness.cpu_model``) name it by model name only, and two AMD EPYC models (one AVX2) share that name and not the
rounding: the same config and seed differ from round 1's loss on. Rerunning round 1 tells, for any such run, whether
this machine would have made it: equal in every ``train/`` figure (same), or not (another CPU, or another code: the
check assumes fedray/'s code of the run, so read it with the record's commits). A run resumed on another machine
after round 1 still reads "same": ``--check-rounds`` further out covers more of it. A single figure may agree by
chance: FedCD's round 1 logs one ``train/`` figure, and one run of another CPU matched it to the bit, not its rounds 2
and 3; so 3 rounds by default.

    .venv/bin/python benchmarks/quality/same_cpu.py privacy_fmnist fedavg_none_seed1 fedcd_none_seed1
    .venv/bin/python benchmarks/quality/same_cpu.py dafkd_decomposition fedavg_steps200_seed1 --check-rounds 1

One JSON line a run: its folder, the CPU its machine.json names, this CPU, how many figures were compared, whether
all were equal and the largest relative difference.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "papers"))

import harness  # noqa: E402


class _Enough(Exception):
    """Raised by the hook once the rounds to compare have run."""


def check(module, folder: str, check_rounds: int) -> dict:
    """Rerun ``folder``'s first rounds here and compare their ``train/`` figures with its history, exactly."""
    import pyarrow.parquet as pq
    import yaml

    from fedray.simulation import RunHooks, run_experiment

    class Keep(RunHooks):  # the protocol's other hooks do nothing
        """Keeps each round's row and stops the run after round ``check_rounds``."""

        def __init__(self):
            self.rows = []

        def on_round(self, row):
            self.rows.append(dict(row))
            if row["round"] >= check_rounds:
                raise _Enough

    runs_dir = harness.RESULTS / f"{module.NAME}_runs"
    seed = folder.rpartition("_seed")[2]
    methods = list(getattr(module, "METHODS", None) or getattr(module, "CELLS"))
    found = [r for r in module.planned(runs_dir, methods, list(module.SETTINGS), [int(seed)]) if r.out.name == folder]
    if not found:
        raise SystemExit(f"{folder}: not a run of {module.NAME}'s grid")
    run = found[0]
    recorded = {r["round"]: r for r in pq.read_table(run.out / "history.parquet").to_pylist()}
    # the rounds the run was asked for, not its last recorded one: a run that a privacy budget stopped early was
    # built (its noise calibrated) for all of them
    rounds = yaml.safe_load((run.out / "config.yaml").read_text())["federation"]["rounds"]
    built = module.build(run, {"rounds": rounds, "device": "cpu", "data_dir": None, "threads": 1,
                               "keep_models": False})
    cfg, data = built if isinstance(built, tuple) else (built, None)
    keep = Keep()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run_experiment(cfg, Path(tmp) / "run", progress=False, data=data, hooks=[keep])
        except _Enough:
            pass
    pairs = [(row[k], recorded[row["round"]][k]) for row in keep.rows for k in row
             if k.startswith("train/") and isinstance(row[k], float) and recorded[row["round"]].get(k) is not None]
    diff = max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=float("nan"))
    return {"run": folder, "its_cpu": harness.run_machine(run.out), "this_cpu": harness.machine_key(
        harness.device_name("cpu")), "figures": len(pairs), "same": bool(pairs) and all(a == b for a, b in pairs),
        "max_rel_diff": diff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("benchmark", help="a script of benchmarks/papers/ (privacy_fmnist, dafkd_decomposition, ...)")
    ap.add_argument("folders", nargs="+", help="run folders of its grid (fedavg_none_seed1)")
    ap.add_argument("--check-rounds", type=int, default=3, help="how many first rounds to rerun and compare")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as the grids run
    module = importlib.import_module(args.benchmark)
    for folder in args.folders:
        print(json.dumps(check(module, folder, args.check_rounds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
