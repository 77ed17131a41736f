"""FedD3A's Table 1 in its own protocol, on fmnist_domains: pretrained models, one round of long local training,
one distillation; the teachers weighted soft (Eq. 6) / onehot / avg / random, beside FedAvg.

The paper starts every model from ImageNet weights and Table 1 is one round of 50 local epochs then one epoch of
distillation on the server's unlabelled domain. Here:

- Pretraining stands in for ImageNet: LeNet-5 trained centrally (one client holding it all: ``fedavg``, one
  round) for ``--pretrain-epochs`` epochs on the ``inverted`` domain's 12,000 training images, a domain no client
  and no server of the runs holds. Its weights are every run's ``model.init``.
- Clients: one a domain (cross-silo) on three of ``original``, ``rotated``, ``noisy``, ``blurred``; the server
  holds the fourth unlabelled, ``blurred`` and ``rotated`` in turn (settings ``server_blurred`` /
  ``server_rotated``).
- One round of ``--local-epochs`` local epochs (momentum SGD lr 0.01, batch 64), then one distillation epoch
  over the server's images (lr 0.01). FedAvg: the same round, averaged. ``soft_scratch``: soft weighting from a
  seeded random draw, to show what the pretraining does.
- Accuracy: the global model on the client domains' test images (``eval/acc_<domain>``, their mean), and the
  teachers' accuracy on the server's domain (``diag/teacher_acc_*``: the simulation's labels, which the method
  never reads).

    .venv/bin/python benchmarks/papers/fedd3a_table1.py --jobs 2
    .venv/bin/python benchmarks/papers/fedd3a_table1.py --report-only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

import harness
from harness import Run, fmt_mean_std

NAME = "fedd3a_table1"
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"algorithm": {"name": "fedavg"}},
    "soft": {"algorithm.weighting": "soft"},
    "onehot": {"algorithm.weighting": "onehot"},
    "avg": {"algorithm.weighting": "avg"},
    "random": {"algorithm.weighting": "random"},
    "soft_scratch": {"algorithm.weighting": "soft", "model.init": None},
}
SETTINGS = {"server_blurred": "blurred", "server_rotated": "rotated"}
CLIENT_POOL = ("original", "rotated", "noisy", "blurred")  # the server takes one, the clients the others
PUBLIC = "inverted"  # the pretraining domain: no client or server of a run holds it
PAPER_TABLE1 = {"avg": 36.9, "random": 36.3, "onehot": 42.0, "soft": 43.9}  # DomainNet, server clipart, ResNet-50
DIAG = ("diag/teacher_acc_soft", "diag/teacher_acc_onehot", "diag/teacher_acc_avg", "diag/teacher_acc_random",
        "diag/teacher_acc_best_single")


def pretrain_config(epochs: int, device: str):
    from fedray.load import load_config

    return load_config("fedd3a_fmnist_domains", {
        "name": "bench_pretrain", "seed": 0, "data.domains": [PUBLIC],
        "data.server_data": {"kind": "none"},
        "algorithm": {"name": "fedavg"}, "federation.rounds": 1, "federation.clients_per_round": 1,
        "federation.local_epochs": epochs, "federation.lr_schedule": "constant", "tracking.enabled": False,
        "runtime.device": device})


def pretrained(runs_dir: Path, epochs: int, device: str) -> Path:
    """The pretrained weights (a fedray run of its own in ``runs_dir``; made once, kept as its model.pt)."""
    from fedray.simulation import run_experiment

    out = Path(runs_dir) / f"pretrain_{PUBLIC}_e{epochs}"
    if not (out / "model.pt").is_file():
        print(f"pretraining LeNet-5 on the {PUBLIC} domain for {epochs} epochs -> {out}", flush=True)
        run_experiment(pretrain_config(epochs, device), out, progress=False)
    return out / "model.pt"


def make_config(method: str, setting: str, seed: int, opts: dict):
    from fedray.load import load_config, validate_config
    from fedray.methods import validate_experiment
    from fedray.overrides import apply_overrides

    raw = load_config("fedd3a_fmnist_domains").model_dump(mode="json")
    spec = dict(METHODS[method])
    if "algorithm" in spec:
        raw["algorithm"] = spec.pop("algorithm")
    server = SETTINGS[setting]
    over = {"name": f"bench_{method}", "seed": seed, "data.domains": list(CLIENT_POOL),
            "data.server_data.domain": server, "federation.rounds": 1, "federation.clients_per_round": 3,
            "federation.local_epochs": opts["local_epochs"], "federation.lr_schedule": "constant",
            "federation.eval_every": 1, "model.init": str(opts["init"]), "tracking.enabled": False,
            "runtime.device": opts["device"], **spec}
    return validate_experiment(validate_config(apply_overrides(raw, over)))


def build(run: Run, opts: dict):
    return make_config(run.method, run.setting, run.seed, opts)


def collect(grid) -> dict[str, list[dict]]:
    res: dict[str, list[dict]] = {}
    for (method, setting), recs in grid.items():
        clients = [d for d in CLIENT_POOL if d != SETTINGS[setting]]
        for f in recs:
            row = f.history[-1]
            res.setdefault(f"{method}|{setting}", []).append({
                "seed": f.seed, "clients_mean": float(np.mean([row[f"eval/acc_{d}"] for d in clients])),
                "domains": {d: row[f"eval/acc_{d}"] for d in clients},
                "diagnostics": {k: row[k] for k in DIAG if row.get(k) is not None}})
    return res


def tables(res: dict, meta: dict, runs_dir: Path, planned: list[Run], opts: dict) -> str:
    lines = harness.header("FedD3A's Table 1 protocol on fmnist_domains: pretrained, one round, one distillation",
                           meta, NAME, runs_dir, planned) + [
        f"LeNet-5 pretrained centrally on the `{PUBLIC}` domain for {opts['pretrain_epochs']} epochs (standing in "
        f"for ImageNet); 3 clients, one a domain; 1 round of {opts['local_epochs']} local epochs (momentum SGD lr "
        "0.01, batch 64) then 1 distillation epoch on the server's domain. Accuracy (%): the global model on the "
        "client domains' test images, mean over them, mean ± std over seeds; teacher accuracy (%) on the server's "
        "domain from `diag/teacher_acc_*`.", "",
        "| server | method | seeds | client domains' mean | minus FedAvg (paired) | teacher soft | onehot | avg | "
        "random | best single |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for setting, server in SETTINGS.items():
        base = {r["seed"]: r["clients_mean"] for r in res.get(f"fedavg|{setting}", [])}
        for method in METHODS:
            rs = res.get(f"{method}|{setting}", [])
            if not rs:
                continue
            diffs = [100 * (r["clients_mean"] - base[r["seed"]]) for r in rs if r["seed"] in base]
            diff = ("" if method == "fedavg" or not diffs else f"{np.mean(diffs):+.2f}"
                    + (f" ± {np.std(diffs, ddof=1) / np.sqrt(len(diffs)):.2f}" if len(diffs) > 1 else ""))
            teach = [fmt_mean_std([r["diagnostics"].get(k) for r in rs if k in r["diagnostics"]]) for k in DIAG]
            lines.append(f"| {server} | {method} | {len(rs)} | {fmt_mean_std([r['clients_mean'] for r in rs])} | "
                         f"{diff} | {' | '.join(teach)} |")
    lines += ["", "±: standard error of the paired difference. The paper's Table 1 (DomainNet, ResNet-50, server "
              "clipart, 50 local epochs): " + ", ".join(f"{m} {v}" for m, v in PAPER_TABLE1.items())
              + "; its ordering soft > onehot > avg ≈ random."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.grid_args(ap, NAME, list(METHODS), list(SETTINGS), rounds=1)
    ap.add_argument("--local-epochs", type=int, default=20, help="the one round's local epochs (the paper: 50)")
    ap.add_argument("--pretrain-epochs", type=int, default=5)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    opts = {"local_epochs": args.local_epochs, "pretrain_epochs": args.pretrain_epochs, "device": args.device,
            "threads": args.threads, "keep_models": args.keep_models,
            "init": Path(args.runs_dir) / f"pretrain_{PUBLIC}_e{args.pretrain_epochs}" / "model.pt"}
    if not args.report_only:
        pretrained(args.runs_dir, args.pretrain_epochs, args.device)
    meta, table_runs = harness.run_grid(NAME, argv, ap, args, build, opts)
    res = collect(harness.collect(table_runs))
    if not res:
        raise SystemExit(f"no finished run in {args.runs_dir}")
    md = tables(res, meta, args.runs_dir, table_runs, opts)
    harness.write(args.out, NAME, meta, {"results": res}, md)
    print(md)


if __name__ == "__main__":
    main()
