"""Per-client models at scale: memory of many clients each holding its own model, and the round time of
heterogeneous clients on Ray against in-process.

    .venv/bin/python benchmarks/speed/per_client.py [--clients 250 1000] [--out benchmarks/results]

(a) Memory: ``algorithm.name=local`` (every client trains only its own model), LeNet-5 on synthetic
    1x28x28 images (61,706 parameters: 247 KB of float32 weights per client, 60 images per client), on the
    Ray runtime with 2 workers, 2 rounds. For each ``--clients`` count N, two runs: every client sampled
    in round 1 (all N then hold their own model), and 10 clients per round (at most 20 hold one). The peak
    proportional set size (PSS) of the driver and every process it started is sampled (as in scale.py);
    the difference between the two runs of one N is what N - 20 client-held models cost, the growth
    between the N's what a registered client costs in all (its data share included).
(b) Round time: 10 clients, all active every round, each with an architecture of the zoo assigned
    round-robin (``model.client_models``), ``--steps`` local SGD steps of batch 32 on synthetic 28x28
    images; mean seconds per training round (rounds 2.., evaluation excluded) in-process (1 thread) and
    on Ray (2 workers x 1 CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from scale import PssSampler  # noqa: E402

from fedray.methods import validate_experiment  # noqa: E402
from fedray.load import load_config  # noqa: E402
from fedray.data import build_federated_data  # noqa: E402
from fedray.simulation import run_experiment  # noqa: E402

HETERO_MODELS = ["lenet5", "mlp", "vgg_small", "resnet8", "resnet11", "mobilenet_v3_small", "resnet18"]


def memory_run(clients: int, per_round: int) -> dict:
    overrides = ["algorithm.name=local", f"data.num_clients={clients}", f"federation.clients_per_round={per_round}",
                 "data.synthetic_image_size=28", f"data.synthetic_train_samples={60 * clients}",
                 "federation.rounds=2", "federation.local_steps=2", "federation.eval_every=2",
                 "runtime.backend=ray", "runtime.num_workers=2", "tracking.enabled=false"]
    cfg = validate_experiment(load_config("synthetic", overrides))
    sampler = PssSampler(period=0.5)
    sampler.start()
    t0 = time.perf_counter()
    result = run_experiment(cfg, progress=False)
    sampler.stop()
    holding = min(clients, per_round * cfg.federation.rounds)
    return {"registered_clients": clients, "clients_per_round": per_round, "clients_holding_a_model_at_most": holding,
            "overrides": overrides,
            "peak_pss_gb": sampler.peak / 2**30, "processes_at_peak": sampler.peak_procs,
            "round_s": [row["time/round_s"] for row in result.history], "total_s": time.perf_counter() - t0,
            "eval/accuracy": result.summary["eval/accuracy"], "eval/amp": result.summary["eval/amp"]}


def round_time(backend: str, steps: int, rounds: int) -> dict:
    models = "[" + ",".join(HETERO_MODELS) + "]"
    overrides = ["algorithm.name=local", "data.num_clients=10", "federation.clients_per_round=10",
                 f"model.client_models={models}", "data.synthetic_image_size=28", "data.alpha=1.0",
                 f"federation.rounds={rounds}", f"federation.local_steps={steps}", f"federation.eval_every={rounds}",
                 f"runtime.backend={backend}", "runtime.num_cpus_per_worker=1", "tracking.enabled=false"]
    if backend == "ray":
        overrides.append("runtime.num_workers=2")
    cfg = validate_experiment(load_config("synthetic", overrides))
    data = build_federated_data(cfg.data, cfg.seed)
    result = run_experiment(cfg, progress=False, data=data)
    times = [row["time/round_s"] for row in result.history]
    return {"backend": backend, "runtime": result.summary["runtime"], "round_s": times,
            "mean_training_round_s": sum(times[1:-1]) / max(len(times) - 2, 1),
            "eval/accuracy": result.summary["eval/accuracy"], "eval/amp": result.summary["eval/amp"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    record: dict = {"benchmark": "per_client", "date": time.strftime("%Y-%m-%d %H:%M"),
                    "machine": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
                                "torch": torch.__version__, "device": "cpu"}}
    record["memory"] = [memory_run(n, per_round) for n in args.clients for per_round in (n, 10)]
    by = {(m["registered_clients"], m["clients_per_round"]): m["peak_pss_gb"] for m in record["memory"]}
    record["pss_mb_per_client_held_model"] = {
        n: (by[n, n] - by[n, 10]) * 1024 / (n - 20) for n in args.clients if n > 20}
    if len(args.clients) >= 2:
        a, b = args.clients[0], args.clients[-1]
        record["pss_mb_per_registered_client_holding_a_model"] = (by[b, b] - by[a, a]) * 1024 / (b - a)
    record["hetero_models"] = HETERO_MODELS
    record["round_time"] = [round_time(be, args.steps, args.rounds) for be in ("local", "ray")]
    loc, ray_ = (r["mean_training_round_s"] for r in record["round_time"])
    record["ray_over_local"] = ray_ / loc
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "per_client.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
