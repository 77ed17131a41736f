"""CPU training rounds and evaluation with and without fedray's malloc tuning and channels-last layouts.

Choices of fedray's, measured against what they replace, on this machine's CPU, one torch thread, in-process:

- ``runtime.malloc_tuning`` (``fedray/runtime/malloc.py``): glibc keeps the memory a batch frees for the next
  batch instead of returning it to the OS and page-faulting it in again;
- the evaluation model's memory layout (``fedray.evaluation.eval_layout``): channels-last for convolutional
  models without GroupNorm on a CPU;
- and the opt-in ``runtime.cpu_channels_last``: training in that layout too (float rounding differs, so its
  accuracy may differ from the others' in the last digits and beyond).

Workload: real Fashion-MNIST, Dirichlet alpha = 0.1, 20 clients, 8 per round, SGD batch 32 (LeNet-5: 20 local
steps, as ``overhead.py``; the ResNets: 5, to keep the run short), one evaluation of the global model on the
global test set and every client's test split (22,000 images). Each variant runs in a fresh process (the
malloc setting is process-wide and one-way), alternating, ``--repeats`` times; a training round is the mean
of rounds 2-5, an evaluation the faster of two; minor page faults and peak RSS come from ``getrusage``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/cpu_malloc.py [--models lenet5 resnet8 resnet8_bn]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from overhead import WORKLOAD, _cpu_name  # noqa: E402

VARIANTS = {  # name: (runtime.malloc_tuning, channels-last evaluation, runtime.cpu_channels_last)
    "glibc_defaults": (False, False, False),
    "malloc_tuning": (True, False, False),
    "malloc_tuning+channels_last_eval": (True, True, False),  # fedray's default
    "+cpu_channels_last (opt-in)": (True, True, True),  # training channels-last too
}

_CHILD = """
import json, resource, sys, time
import numpy as np, torch
import fedray.evaluation, fedray.runtime.core
from fedray.load import load_config
from fedray.data import build_federated_data
from fedray.runtime import make_runtime
from fedray.seeding import sample_clients

overrides, channels_last = json.loads(sys.argv[1]), sys.argv[2] == "1"
if not channels_last:  # the evaluation model as built
    fedray.evaluation.eval_layout = fedray.runtime.core.eval_layout = lambda model, device: model
cfg = load_config("quickstart", overrides)
data = build_federated_data(cfg.data, cfg.seed)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds, round_faults, evals, eval_faults = [], [], [], []
with make_runtime(cfg, data) as rt:
    for r in range(1, 6):
        f0, t0 = faults(), time.perf_counter()
        rt.run_round(r, sample_clients(cfg.seed, r, data.num_clients, cfg.federation.clients_per_round))
        if r > 1:
            rounds.append(time.perf_counter() - t0)
            round_faults.append(faults() - f0)
    for _ in range(2):
        f0, t0 = faults(), time.perf_counter()
        acc = rt.evaluate()["eval/accuracy"]
        evals.append(time.perf_counter() - t0)
        eval_faults.append(faults() - f0)
print(json.dumps({"round_s": float(np.mean(rounds)), "round_faults": float(np.mean(round_faults)),
                  "eval_s": min(evals), "eval_faults": eval_faults[int(np.argmin(evals))], "accuracy": acc,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_variant(model: str, tuning: bool, channels_last: bool, train_channels_last: bool, data_dir: str | None) -> dict:
    overrides = [*WORKLOAD, f"model.name={model}", "tracking.enabled=false", f"runtime.malloc_tuning={tuning}",
                 f"runtime.cpu_channels_last={train_channels_last}"]
    if model != "lenet5":
        overrides.append("federation.local_steps=5")
    if data_dir:
        overrides.append(f"data.data_dir={data_dir}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(overrides), str(int(channels_last))], env=env,
                         cwd=HERE.parents[1], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["lenet5", "resnet8", "resnet8_bn"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()
    results: dict[str, dict[str, list[dict]]] = {m: {v: [] for v in VARIANTS} for m in args.models}
    for _ in range(args.repeats):
        for model in args.models:
            for name, (tuning, cl, train_cl) in VARIANTS.items():
                results[model][name].append(run_variant(model, tuning, cl, train_cl, args.data_dir))
                print(model, name, results[model][name][-1], flush=True)
    rows = []
    lines = [f"{'model':<11} {'variant':<34} {'round s':>8} {'faults/round':>12} {'eval s':>7} {'faults/eval':>11} "
             f"{'peak RSS MB':>11} {'accuracy':>8}"]
    for model, by_variant in results.items():
        for name, runs in by_variant.items():
            med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
            rows.append({"model": model, "variant": name, **med, "runs": runs})
            lines.append(f"{model:<11} {name:<34} {med['round_s']:>8.3f} {med['round_faults']:>12.0f} "
                         f"{med['eval_s']:>7.3f} {med['eval_faults']:>11.0f} {med['peak_rss_mb']:>11.0f} "
                         f"{med['accuracy']:>8.4f}")
    lines.append(f"medians of {args.repeats} fresh processes per row; machine: {_cpu_name()}, {os.cpu_count()} CPUs, "
                 f"{platform.platform()}; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    record = {"benchmark": "cpu_malloc", "date": time.strftime("%Y-%m-%d %H:%M"), "workload": WORKLOAD,
              "machine": {"cpu": _cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_1_5_15_before": load_before, "load_avg_1_5_15_after": os.getloadavg()},
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_malloc.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "cpu_malloc.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
