"""A million clients on one machine: what a run costs with clients made on demand, at 10,000, 100,000 and 1,000,000
registered clients and 1,000 a round (issue 70).

    .venv/bin/python benchmarks/speed/million.py [--clients 10000 100000 1000000] [--per-round 1000] [--rounds 3]
        [--data synthetic fmnist] [--system off on] [--runtimes local ray] [--out benchmarks/results]
    .venv/bin/python benchmarks/speed/million.py --floor-only   # Ray's floor alone, into the record

Each cell runs in a process of its own (so that its peak memory is its own): ``fedray``'s ``synthetic`` preset with
``data.partition=on_demand`` (synthetic 1x16x16 images, a fixed base of 20,000; clients of 60 examples on average)
or Fashion-MNIST pseudo-clients (``data.pseudo_base_clients=1000`` of a Dirichlet alpha = 0.5 partition), LeNet-5,
10 SGD steps of batch 32, one thread a client worker, ``--per-round`` clients a round for ``--rounds`` rounds,
evaluated after the last (the global test set and 100 clients' local splits); with ``--system on`` the simulated
system with a device trace and a 20-interval-a-client availability trace (benchmarks/speed/system_scale.py's), in
process (``local``) or on Ray with 2 client workers. Per cell: start-up (from the config's loading, after Python's
imports, to the run's set-up done before round 1: data, runtime, Ray), the peak proportional set size of the process tree (PSS: shared pages counted once,
sampled every second, Ray's processes included), the median round time (rounds 2..R: round 1 pays one-off costs), and
the clients derived in process (the sampled plus the evaluated; on Ray the workers make them). Targets (issue 70): a round at 1,000,000 within 1.1x of the same
round at 10,000; peak under 4 GB in process without the system, under 6 GB with its availability trace, at most 1 GB
more on Ray; start-up under 60 s. With the Ray cells, Ray's floor: what Ray and its idle workers cost before any data
or client (each worker imports torch), so that a Ray cell's extra splits into Ray's and the run's. Writes
``OUT/million.json`` and ``OUT/million.md``.
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

sys.path.insert(0, str(Path(__file__).parent))
from system_scale import system_overrides  # noqa: E402

TARGETS = {"round_ratio": 1.1, "peak_local_gb": 4.0, "peak_local_system_gb": 6.0, "ray_extra_gb": 1.0,
           "startup_s": 60.0}
RAY_WORKERS = 2  # client workers of a Ray cell: one a core here


def cell_overrides(clients: int, per_round: int, rounds: int, data: str, system: bool, runtime: str,
                   traces: Path | None) -> list[str]:
    out = [f"data.num_clients={clients}", f"federation.clients_per_round={per_round}", f"federation.rounds={rounds}",
           f"federation.eval_every={rounds}", "federation.local_steps=10", "federation.batch_size=32",
           "model.name=lenet5", "data.eval_clients=100", "tracking.enabled=false", f"runtime.backend={runtime}"]
    if data == "synthetic":
        out += ["data.dataset=synthetic", "data.partition=on_demand", "data.client_size=60"]
    else:
        out += ["data.dataset=fashion_mnist", "data.pseudo_base_clients=1000", "data.alpha=0.5",
                "data.min_samples=2"]
    if runtime == "ray":
        out += [f"runtime.num_workers={RAY_WORKERS}", "runtime.num_cpus_per_worker=1"]
    if system and traces is not None:
        out += system_overrides(traces / "devices.parquet", traces / "online.parquet")
    return out


def run_cell(overrides: list[str]) -> dict:
    """One cell in this process (``--cell``): its figures as JSON on stdout."""
    import numpy as np
    import torch

    from fedray.data import build_federated_data
    from fedray.load import load_config
    from fedray.simulation import run_experiment
    from scale import PssSampler

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    sampler = PssSampler()
    sampler.start()
    cfg = load_config("synthetic", overrides)
    data = build_federated_data(cfg.data, cfg.seed)
    ends: list[float] = []

    class Marks:  # start-up ends when the run is set up (on_start), then each round's end
        def on_start(self, cfg, data): ends.append(time.perf_counter() - t0)
        def on_round(self, row): ends.append(time.perf_counter() - t0)
        def on_end(self, result): pass
        def on_error(self, exc): pass

    result = run_experiment(cfg, progress=False, data=data, hooks=[Marks()])
    sampler.stop()
    rounds = [row["time/round_s"] for row in result.history]
    return {"startup_s": ends[0], "round_s": rounds,
            "peak_pss_gb": sampler.peak / 2**30, "processes_at_peak": sampler.peak_procs,
            # on Ray the clients are made in the workers, whose counts this process does not see
            "derivations": int(data.source.derivations) if cfg.runtime.backend == "local" else None,
            "eval/accuracy": result.summary.get("eval/accuracy"),
            "runtime": result.summary.get("runtime")}


def run_floor(workers: int) -> dict:
    """Ray's own cost here (``--floor-only``): the process tree's PSS with a local Ray started as a run starts it and
    ``workers`` idle actors that imported torch and the client worker's code, less this process's before Ray started;
    no data, no client, no model. What a Ray cell adds above its in-process cell beyond this is the run's."""
    import psutil
    import ray
    import torch  # noqa: F401  (the driver of a run has imported it before Ray starts)

    from fedray.load import load_config
    from fedray.runtime.ray_start import start_ray

    def tree() -> list[tuple[str, int]]:
        me, rows = psutil.Process(), []
        for p in [me, *me.children(recursive=True)]:
            try:
                rows.append((p.name() if p.pid != me.pid else "driver", p.memory_full_info().pss))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return rows

    before = sum(pss for _, pss in tree())
    start_ray(load_config("synthetic", ["runtime.backend=ray"]))

    @ray.remote(num_cpus=1)
    class Idle:
        def __init__(self):
            import fedray.runtime.core  # noqa: F401  (torch with it)

        def pid(self) -> int:
            return os.getpid()

    actors = [Idle.remote() for _ in range(workers)]
    ray.get([a.pid.remote() for a in actors])
    time.sleep(3)  # Ray's agents settle after the workers start
    rows = tree()
    ray.shutdown()
    workers_gb = [pss / 2**30 for name, pss in rows if name.startswith("ray::Idle")]
    return {"workers": workers, "extra_gb": (sum(pss for _, pss in rows) - before) / 2**30,
            "per_worker_gb": sum(workers_gb) / max(len(workers_gb), 1)}


def round_s(result: dict) -> float:
    """A cell's round time: the median of rounds 2..R (round 1 pays one-off costs; the median, because this
    machine's CPU time varies by tens of percent from minute to minute, a round at a time)."""
    import numpy as np

    rounds = result["round_s"]
    return float(np.median(rounds[1:] or rounds))


def markdown(record: dict) -> str:
    lines = ["# A million clients on one machine", "",
             f"Recorded {record['date']} on {record['machine']}; command: `{record['command']}`.", "",
             "| data | system | runtime | registered | start-up (s) | peak PSS (GB) | round (s) | derived |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in record["cells"]:
        r = c["result"]
        if "error" in r:
            lines.append(f"| {c['data']} | {c['system']} | {c['runtime']} | {c['clients']:,} | failed: {r['error']} "
                         "| | | |")
            continue
        lines.append(f"| {c['data']} | {c['system']} | {c['runtime']} | {c['clients']:,} | {r['startup_s']:.1f} | "
                     f"{r['peak_pss_gb']:.2f} | {round_s(r):.2f} | "
                     f"{'—' if r['derivations'] is None else format(r['derivations'], ',')} |")
    floor = record.get("ray_floor")
    if floor:
        lines += ["", f"Ray's floor here: {floor['extra_gb']:.2f} GB above the driver alone, with {floor['workers']} "
                  f"idle workers ({floor['per_worker_gb']:.2f} GB each: torch and the worker's code imported) and "
                  "Ray's own processes, before any data, client or model (`--floor-only`); \"above floor\" is a Ray "
                  "cell's extra less this."]
    lines += ["", "Targets (issue 70): " + "; ".join(f"{k} {v:g}" for k, v in record["targets"].items()), "",
              "| data | system | runtime | round at max / at min registered | peak at max (GB) | Ray's extra (GB) "
              "| above floor (GB) | slowest start-up (s) | met |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += [target_row(record, key) for key in sorted({(c["data"], c["system"], c["runtime"])
                                                         for c in record["cells"]})]
    return "\n".join(lines) + "\n"


def target_row(record: dict, key: tuple[str, str, str]) -> str:
    """One (data, system, runtime)'s figures against the targets: the round at the most registered clients over the
    round at the fewest, the peak at the most (against 4 GB, or 6 GB with the system's traces; on Ray, its excess
    over the in-process cell's against 1 GB), the slowest start-up."""
    t = record["targets"]
    data, system, runtime = key
    ok = {c["clients"]: c["result"] for c in record["cells"]
          if (c["data"], c["system"], c["runtime"]) == key and "error" not in c["result"]}
    if len(ok) < 2:
        return f"| {data} | {system} | {runtime} | not measured | | | | | no |"
    lo, hi = ok[min(ok)], ok[max(ok)]
    ratio = round_s(hi) / round_s(lo)
    startup = max(r["startup_s"] for r in ok.values())
    met = ratio <= t["round_ratio"] and startup <= t["startup_s"]
    extra = above = "—"
    if runtime == "local":
        met &= hi["peak_pss_gb"] <= t["peak_local_system_gb" if system == "on" else "peak_local_gb"]
    else:
        here = [c["result"] for c in record["cells"] if (c["data"], c["system"], c["runtime"], c["clients"])
                == (data, system, "local", max(ok)) and "error" not in c["result"]]
        if here:
            extra = f"{hi['peak_pss_gb'] - here[0]['peak_pss_gb']:.2f}"
            if record.get("ray_floor"):
                above = f"{hi['peak_pss_gb'] - here[0]['peak_pss_gb'] - record['ray_floor']['extra_gb']:.2f}"
            met &= hi["peak_pss_gb"] - here[0]["peak_pss_gb"] <= t["ray_extra_gb"]
        else:
            met = False
    return (f"| {data} | {system} | {runtime} | {ratio:.2f} | {hi['peak_pss_gb']:.2f} | {extra} | {above} | "
            f"{startup:.1f} | "
            f"{'yes' if met else 'no'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--per-round", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", nargs="+", default=["synthetic", "fmnist"], choices=["synthetic", "fmnist"])
    ap.add_argument("--system", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--runtimes", nargs="+", default=["local", "ray"], choices=["local", "ray"])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--cell", nargs="*", help=argparse.SUPPRESS)  # one cell's overrides, run in this process
    ap.add_argument("--floor-cell", type=int, help=argparse.SUPPRESS)  # Ray's floor with N workers, in this process
    ap.add_argument("--floor-only", action="store_true", help="measure Ray's floor alone into OUT/million.json (its "
                    "cells kept)")
    ap.add_argument("--report-only", action="store_true", help="rewrite OUT/million.md from OUT/million.json")
    ap.add_argument("--merge", action="store_true", help="replace only these cells in OUT/million.json (a cell "
                    "rerun on a quiet machine)")
    args = ap.parse_args()
    if args.report_only:
        out = Path(args.out)
        (out / "million.md").write_text(markdown(json.loads((out / "million.json").read_text())))
        return
    if args.cell is not None:
        print(json.dumps(run_cell(args.cell)))
        return
    if args.floor_cell is not None:
        print(json.dumps(run_floor(args.floor_cell)))
        return
    sys.path.insert(0, str(Path(__file__).parents[1] / "papers"))
    from harness import device_name

    from system_scale import write_traces

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cells, floor = [], None
    if "ray" in args.runtimes:
        done = subprocess.run([sys.executable, __file__, "--floor-cell", str(RAY_WORKERS)], capture_output=True,
                              text=True)
        floor = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
        print(json.dumps({"ray_floor": floor}), flush=True)
    if args.floor_only:
        args.clients, args.merge = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for clients in args.clients:
            traces = None
            if "on" in args.system:
                traces = Path(tmp) / str(clients)
                traces.mkdir()
                write_traces(traces, clients, 20)
            for data in args.data:
                for system in args.system:
                    for runtime in args.runtimes:
                        overrides = cell_overrides(clients, args.per_round, args.rounds, data, system == "on",
                                                   runtime, traces)
                        done = subprocess.run([sys.executable, __file__, "--cell", *overrides], capture_output=True,
                                              text=True)
                        result = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                                  else {"error": done.stderr.strip().splitlines()[-1][:200]})
                        cells.append({"clients": clients, "data": data, "system": system, "runtime": runtime,
                                      "result": result})
                        print(json.dumps(cells[-1]), flush=True)
    command = "benchmarks/speed/million.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    if args.merge:  # the earlier record's other cells kept, in their order; the command of each part listed
        record = json.loads((out / "million.json").read_text())
        key = lambda c: (c["clients"], c["data"], c["system"], c["runtime"])  # noqa: E731
        fresh = {key(c): c for c in cells}
        record["cells"] = [fresh.pop(key(c), c) for c in record["cells"]] + list(fresh.values())
        record["command"] += f"; then {command}"
        record["ray_floor"] = floor or record.get("ray_floor")
        record["machine"] = device_name("cpu")  # the machine of the rerun cells: rerun them on the record's
    else:
        record = {"benchmark": "million", "date": time.strftime("%Y-%m-%d %H:%M"),
                  "machine": device_name("cpu"),
                  "command": command, "targets": TARGETS, "ray_floor": floor, "cells": cells}
    out.mkdir(parents=True, exist_ok=True)
    (out / "million.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "million.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
