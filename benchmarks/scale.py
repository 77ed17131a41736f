"""Scale: 10,000 registered clients, 100 per round, on the Ray runtime of one 2-core machine.

    .venv/bin/python benchmarks/scale.py [--rounds 3] [--out benchmarks/results]

Runs ``fedray run synthetic data.num_clients=10000 federation.clients_per_round=100 runtime.backend=ray``
for 3 rounds (evaluating after the last) while sampling the proportional set size (PSS: shared pages
counted once) of the driver and every process it started (Ray's GCS, raylet, workers), and times the
same local steps as a plain single-process loop (the compute floor; see overhead.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from overhead import plain_loop  # noqa: E402

from fedray.config import load_config  # noqa: E402
from fedray.data import build_federated_data  # noqa: E402
from fedray.simulation import run_experiment  # noqa: E402


class PssSampler(threading.Thread):
    """Peak total PSS of this process and all its descendants, sampled every ``period`` seconds."""

    def __init__(self, period: float = 1.0):
        super().__init__(daemon=True)
        self.period, self.peak, self.peak_procs, self._halt = period, 0, 0, threading.Event()

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
            self.peak, self.peak_procs = total, n
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
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    overrides = ["data.dataset=synthetic", "data.num_clients=10000", "federation.clients_per_round=100",
                 f"federation.rounds={args.rounds}", f"federation.eval_every={args.rounds}"]
    cfg = load_config("synthetic", overrides + ["runtime.backend=ray"])

    sampler = PssSampler()
    sampler.start()
    t0 = time.perf_counter()
    data = build_federated_data(cfg.data, cfg.seed)
    data_s = time.perf_counter() - t0
    result = run_experiment(cfg, progress=False, data=data)
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
        "round2_ray_over_floor": ray_times[1] / floor_times[1] if len(ray_times) > 2 else None,
        "eval/accuracy": result.summary["eval/accuracy"], "eval/amp": result.summary["eval/amp"],
        "total_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("machine", "overrides")}, indent=2))


if __name__ == "__main__":
    main()
