"""The simulated system at scale: 100,000 registered clients with a device trace and an availability trace.

    .venv/bin/python benchmarks/speed/system_scale.py [--clients 100000] [--per-round 1000] [--intervals 20]
                                                     [--rounds 3] [--out benchmarks/results]

Writes the two traces (parquet: one device row per client; ``--intervals`` online intervals per client over a
simulated week, each 90 % of its period), then measures (a) the memory the system model adds: Python/numpy allocations (tracemalloc) and
the process's resident set growth while the traces are read and the clock is built; (b) the clock's own time per
round (sampling 1,000 of the online clients, their finish times and arrivals, the round's end); (c) a training
round of 1,000 clients in process (synthetic 1x16x16 images, LeNet-5, 10 SGD steps of 32, one thread), with the
system on and off: the mean of rounds 2..R (round 1 pays one-off start-up); (d) the size of the timed run's
per-client event record (events.parquet: a row per selected client and round); (e) the clock's time per round
with Oort's selection (``system.selection=oort``) instead of the uniform draw. Targets (issue 50): under 200 MB and
under 5 % of a round.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from fedray.load import load_config
from fedray.data import build_federated_data
from fedray.simulation import run_experiment
from fedray.system import SystemClock

WEEK_S = 7 * 24 * 3600.0


def write_traces(folder: Path, clients: int, intervals: int, seed: int = 0) -> tuple[Path, Path]:
    rng = np.random.default_rng(seed)
    devices = folder / "devices.parquet"
    pq.write_table(pa.table({"client": np.arange(clients), "compute_sps": 17 * np.exp(0.9 * rng.standard_normal(clients)),
                             "up_mbps": 3.1 * np.exp(0.7 * rng.standard_normal(clients)),
                             "down_mbps": 5.2 * np.exp(0.48 * rng.standard_normal(clients)),
                             "latency_ms": 35 * np.exp(0.5 * rng.standard_normal(clients))}), devices)
    # per client: a period of WEEK / intervals, online for 90 % of it from a random phase, so that ~90 % of the
    # clients are online at any time and a round trains as many clients with the system as without it
    period = WEEK_S / intervals
    phase = rng.uniform(0, period, (clients, 1))
    k = np.arange(-1, intervals)[None, :]
    starts, ends = np.maximum(k * period + phase, 0.0), k * period + phase + 0.9 * period
    keep = ends > 0
    client_of = np.broadcast_to(np.arange(clients)[:, None], keep.shape)[keep]
    starts, ends = starts[keep], ends[keep]
    online = folder / "online.parquet"
    pq.write_table(pa.table({"client": client_of, "start_s": starts, "end_s": ends}), online)
    return devices, online


def system_overrides(devices: Path, online: Path) -> list[str]:
    return ["system.devices=trace", f"system.trace={devices}", "system.availability=trace",
            f"system.availability_trace={online}"]


def clock_cost(cfg, clients: int, rounds: int = 20, oort: bool = False) -> tuple[dict, float]:
    """(memory figures of building the clock, mean seconds of its work per round). ``oort``: the clients report
    statistical utilities (drawn here) for Oort's selection."""
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    tracemalloc.start()
    t0 = time.perf_counter()
    clock = SystemClock(cfg.system, clients, cfg.federation.clients_per_round, cfg.seed)
    clock.register(np.full(clients, 60))
    build_s = time.perf_counter() - t0
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = psutil.Process().memory_info().rss - rss0
    per_round = []
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        ids = clock.select(r)
        utility = 60 * (1 + np.random.default_rng(r).random(len(ids))) if oort else None
        clock.admit(ids, [320] * len(ids), [250_000] * len(ids), 250_000, utility)
        clock.end_round(0)
        per_round.append(time.perf_counter() - t0)
    memory = {"traced_mb_kept": current / 1e6, "traced_mb_peak": peak / 1e6, "rss_growth_mb": rss / 1e6,
              "build_s": build_s}
    return memory, float(np.mean(per_round))


def round_times(cfg, data, output_dir: Path | None = None) -> list[float]:
    result = run_experiment(cfg, output_dir, progress=False, data=data)
    return [row["time/round_s"] for row in result.history]


def event_record(run_dir: Path) -> dict:
    """events.parquet's size on disk, its rows and bytes a row."""
    from fedray.record.run_dir import EVENTS_FILE

    path = run_dir / EVENTS_FILE
    rows = pq.read_metadata(path).num_rows
    return {"bytes": path.stat().st_size, "rows": rows, "bytes_per_row": path.stat().st_size / rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100_000)
    ap.add_argument("--per-round", type=int, default=1000)
    ap.add_argument("--intervals", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    base = ["data.dataset=synthetic", f"data.num_clients={args.clients}",
            f"federation.clients_per_round={args.per_round}", f"federation.rounds={args.rounds}",
            f"federation.eval_every={args.rounds + 1}", "runtime.backend=local", "runtime.num_cpus_per_worker=1",
            "tracking.enabled=false"]
    with tempfile.TemporaryDirectory() as tmp:
        devices, online = write_traces(Path(tmp), args.clients, args.intervals)
        timed_cfg = load_config("synthetic", base + system_overrides(devices, online))
        memory, clock_s = clock_cost(timed_cfg, args.clients)
        oort_cfg = load_config("synthetic", base + system_overrides(devices, online) + ["system.selection=oort"])
        _, oort_clock_s = clock_cost(oort_cfg, args.clients, oort=True)
        data = build_federated_data(timed_cfg.data, timed_cfg.seed)
        plain = round_times(load_config("synthetic", base), data, Path(tmp) / "plain")  # both write a run folder
        timed = round_times(timed_cfg, data, Path(tmp) / "run")
        events = event_record(Path(tmp) / "run")
    # the last round also evaluates (eval_every > rounds evaluates only the last): rounds 2..R-1 when R > 2
    window = slice(1, -1) if args.rounds > 2 else slice(1, None)
    plain_s, timed_s = float(np.mean(plain[window])), float(np.mean(timed[window]))
    record = {"benchmark": "system_scale", "date": time.strftime("%Y-%m-%d %H:%M"), "clients": args.clients,
              "per_round": args.per_round, "intervals_per_client": args.intervals, "memory": memory,
              "clock_s_per_round": clock_s, "clock_s_per_round_oort": oort_clock_s, "events": events,
              "round_s_plain": plain, "round_s_system": timed,
              "round_s_plain_mean": plain_s, "round_s_system_mean": timed_s,
              "clock_share_of_round": clock_s / plain_s, "round_ratio": timed_s / plain_s,
              "machine": {"cpus": os.cpu_count(), "threads": 1}}
    added_mb = max(memory["traced_mb_peak"], memory["rss_growth_mb"])
    record["targets_met"] = {"under_200_mb": added_mb < 200, "clock_under_5pct_of_round": clock_s / plain_s < 0.05}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "system_scale.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
