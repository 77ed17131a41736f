"""Scale: 100,000 registered clients, 1,000 per round, on the Ray runtime (2 workers) of one 2-core machine.

    .venv/bin/python benchmarks/speed/scale.py [--clients 100000] [--per-round 1000] [--rounds 3] [--out benchmarks/results]

Runs ``fedray run synthetic data.num_clients=100000 federation.clients_per_round=1000 runtime.backend=ray``
(synthetic 1x16x16 images, 60 per client, LeNet-5, 10 SGD steps of 32) for 4 rounds, evaluating after the
last, while sampling the proportional set size (PSS: shared pages counted once) of the driver and every
process it started (Ray's GCS, raylet, workers), and times the same local steps as a plain single-process
loop of one thread (the compute floor; see overhead.py). Targets (issue 13): peak PSS under 8 GB, a training
round (mean of rounds 2..R-1: round 1 pays one-off start-up in every process, round R also evaluates all
100,000 clients) within 1.3x of the floor's. ``on_start`` marks the end of start-up (data in the store).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from overhead import plain_loop  # noqa: E402

from fedray.load import load_config  # noqa: E402
from fedray.data import build_federated_data  # noqa: E402
from fedray.simulation import run_experiment  # noqa: E402


class PssSampler(threading.Thread):
    """Peak total PSS of this process and all its descendants, sampled every ``period`` seconds."""

    def __init__(self, period: float = 1.0):
        super().__init__(daemon=True)
        self.period, self.peak, self.peak_procs, self._halt = period, 0, 0, threading.Event()
        self.t0, self.peak_at = time.perf_counter(), 0.0

    def sample(self) -> int:
        me = psutil.Process()
        total, n = 0, 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
                n += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        if total > self.peak:
            self.peak, self.peak_procs, self.peak_at = total, n, time.perf_counter() - self.t0
        return total

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100_000)
    ap.add_argument("--per-round", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    overrides = ["data.dataset=synthetic", f"data.num_clients={args.clients}",
                 f"federation.clients_per_round={args.per_round}", f"federation.rounds={args.rounds}",
                 f"federation.eval_every={args.rounds}", "runtime.num_workers=2", "runtime.num_cpus_per_worker=1"]
    cfg = load_config("synthetic", overrides + ["runtime.backend=ray"])

    sampler = PssSampler()
    sampler.start()
    round_ends: list[float] = []

    class RoundEnds:  # when each round ended, to place the memory peak (seconds since the sampler started)
        def on_start(self, cfg, data): round_ends.append(time.perf_counter() - sampler.t0)
        def on_round(self, row): round_ends.append(time.perf_counter() - sampler.t0)
        def on_end(self, result): pass
        def on_error(self, exc): pass

    hook = RoundEnds()
    t0 = time.perf_counter()
    data = build_federated_data(cfg.data, cfg.seed)
    data_s = time.perf_counter() - t0
    result = run_experiment(cfg, progress=False, data=data, hooks=[hook])
    sampler.stop()

    torch.set_num_threads(1)
    floor_times, _ = plain_loop(load_config("synthetic", overrides), data)
    ray_times = [row["time/round_s"] for row in result.history]
    record = {
        "benchmark": "scale", "date": time.strftime("%Y-%m-%d %H:%M"), "overrides": overrides,
        "machine": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
                    "torch": torch.__version__, "device": "cpu"},
        "runtime": result.summary["runtime"],
        "registered_clients": data.num_clients, "train_images": int(len(data.train_y)),
        "data_build_s": data_s,
        "peak_pss_gb": sampler.peak / 2**30, "processes_at_peak": sampler.peak_procs,
        "ray_round_s": ray_times, "floor_round_s": floor_times,
        # rounds 2..R-1: round 1 pays one-off start-up in every process, round R also evaluates every client
        "ray_over_floor": float(np.mean(ray_times[1:-1]) / np.mean(floor_times[1:-1])) if len(ray_times) > 2 else None,
        "peak_at_s": sampler.peak_at, "round_ends_s": round_ends,
        "eval/accuracy": result.summary["eval/accuracy"], "eval/amp": result.summary["eval/amp"],
        "total_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record["targets_met"] = {"peak_pss_under_8gb": record["peak_pss_gb"] < 8.0,
                             "round_within_1.3x_floor": record["ray_over_floor"] is not None
                             and record["ray_over_floor"] <= 1.3}
    (out / "scale.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("machine", "overrides")}, indent=2))


if __name__ == "__main__":
    main()
