"""Where DaFKD's server round goes (issue 13): its phases timed with the device synchronised around each.

The server's part of a round is the same work in the sequential baseline and in the vectorised round, so it caps
the vectorised speed-up: on an H100 a graphed 8-client DaFKD round (`gpu.py`'s dafkd_resnet11) spent 0.79 s of
2.05 s in the server, the 32-client one without diag/* 0.89 of 5.34 s. Which phase of Algorithm 1's lines 9-13
holds that time says what to make faster:

  average        Eq. 6 and Eq. 4: the weighted averages of the K classifiers and generators (float64, host order)
  set            the distillation set: the broadcast generator on ``distill_samples`` noise vectors
  teacher        Eq. 7: the K uploaded classifiers and discriminators on the set, stacked, and their weights
  distil         Eq. 8: ``distill_steps`` KD steps from the average; within it
    first 2 steps  eager, then the CUDA graph's capture (runtime.cuda_graphs, SGD)
    other steps    replayed (each synchronised here, which costs the replays their overlap with the host)
  diag           the simulation-only diag/* (``algorithm.diag_samples``; 0 in the *_nodiag workload)
  other          the server total (``ServerCore.aggregate``) less the phases: the uploads' checks, state packing

In-process, vectorised clients with CUDA graphs, `gpu.py`'s synthetic Fashion-MNIST-sized data; each phase's mean
over rounds 2.. (round 1 pays cuDNN's and the allocator's first use). Writes ``OUT/server_phases.{json,md}``.

    python3 benchmarks/speed/server_phases.py --out $OUT [--per-round 8 32] [--rounds 3] [--workloads dafkd_resnet11_nodiag]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/server_phases.py --device cpu --per-round 2 --rounds 2 \
        --workloads dafkd_resnet11_nodiag --out /tmp/sp  # dry run, ~8 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import platform
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from fedray.methods.dafkd import server as dafkd_server
from fedray.methods.dafkd import DaFKD
from fedray.learning.distill import KDSteps
from fedray.load import load_config
from fedray.runtime.server_core import ServerCore
from fedray.simulation import RunHooks, run_experiment

from gpu import BASE, WORKLOADS  # noqa: E402  (benchmarks/speed/ is this script's folder, first on sys.path)

PHASES = ["average", "set", "teacher", "distil", "first 2 steps", "other steps", "diag", "other", "server total"]


class PhaseClock(RunHooks):
    """A run hook: seconds per phase of each round; ``patch`` wraps the server's functions with synchronised timers."""

    def __init__(self, device: str):
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[float] = []
        self.rounds: list[dict[str, float]] = []

    def timed(self, phase: str, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                seconds = time.perf_counter() - t0
                if phase == "step":
                    self.steps.append(seconds)
                else:
                    self.now[phase] += seconds
        return run

    def patch(self, stack: contextlib.ExitStack) -> None:
        """Wrap the phases where server_round and ServerCore look them up (the module's names, the classes')."""
        for owner, name, phase in [(dafkd_server, "weighted_average", "average"), (DaFKD, "distillation_set", "set"),
                                   (dafkd_server, "ensemble_teacher", "teacher"), (dafkd_server, "distil", "distil"),
                                   (KDSteps, "step", "step"), (DaFKD, "probe_diagnostics", "diag"),
                                   (ServerCore, "aggregate", "server total")]:
            stack.callback(setattr, owner, name, getattr(owner, name))
            setattr(owner, name, self.timed(phase, getattr(owner, name)))

    def on_round(self, row: dict) -> None:
        r = dict(self.now)
        r["first 2 steps"], r["other steps"] = sum(self.steps[:2]), sum(self.steps[2:])
        r["other"] = r.get("server total", 0.0) - sum(r.get(p, 0.0) for p in ("average", "set", "teacher", "distil",
                                                                             "diag"))
        self.rounds.append(r)
        self.now.clear()
        self.steps.clear()


def measure(workload: str, k: int, rounds: int, device: str) -> dict:
    overrides = BASE + WORKLOADS[workload] + [
        f"data.num_clients={int(2.5 * k)}", f"federation.clients_per_round={k}", f"federation.rounds={rounds}",
        "federation.eval_every=1000", f"runtime.device={device}", "runtime.vectorize=true", "runtime.cuda_graphs=true"]
    clock = PhaseClock(device)
    with contextlib.ExitStack() as stack:
        clock.patch(stack)
        try:
            result = run_experiment(load_config(None, overrides), progress=False, hooks=[clock])
        except Exception as exc:  # the next row still runs (device time is scarce)
            return {"workload": workload, "clients_per_round": k, "error": f"{type(exc).__name__}: {exc}"[:500]}
    later = clock.rounds[1:] or clock.rounds
    return {"workload": workload, "clients_per_round": k, "rounds": clock.rounds,
            "round_s": float(np.mean([r["time/round_s"] for r in result.history[1:] or result.history])),
            "phases_s": {p: float(np.mean([r.get(p, 0.0) for r in later])) for p in PHASES}}


def write(record: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_phases.json").write_text(json.dumps(record, indent=2) + "\n")
    rows = [r for r in record["rows"] if not r.get("error")]
    lines = [f"# DaFKD's server round by phase ({record['device']}, torch {record['torch']}, {record['date']})", "",
             "Seconds per round (mean of rounds 2..), device synchronised around each phase; in-process, vectorised "
             "clients with CUDA graphs.", "",
             "| phase | " + " | ".join(f"{r['workload']}, K={r['clients_per_round']}" for r in rows) + " |",
             "| --- |" + " ---: |" * len(rows)]
    for p in PHASES:
        cells = [(r["phases_s"][p], r["phases_s"]["server total"]) for r in rows]
        shown = [f"{sec:.3f} ({sec / total:.0%})" if total else "-" for sec, total in cells]
        lines.append(f"| {p} | " + " | ".join(shown) + " |")
    lines.append("| round (all) | " + " | ".join(f"{r['round_s']:.3f}" for r in rows) + " |")
    lines += [f"\n{r['workload']}, K={r['clients_per_round']}: failed: {r['error']}"
              for r in record["rows"] if r.get("error")]
    (out / "server_phases.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/gpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--workloads", nargs="+", default=["dafkd_resnet11", "dafkd_resnet11_nodiag"],
                    choices=[w for w in WORKLOADS if w.startswith("dafkd")])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or platform.machine()
    record = {"device": device, "torch": torch.__version__, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
              "rows": []}
    for workload in args.workloads:
        for k in args.per_round:
            record["rows"].append(measure(workload, k, args.rounds, args.device))
            print(json.dumps({key: v for key, v in record["rows"][-1].items() if key != "rounds"}), flush=True)
            write(record, Path(args.out))
    print((Path(args.out) / "server_phases.md").read_text())


if __name__ == "__main__":
    main()
