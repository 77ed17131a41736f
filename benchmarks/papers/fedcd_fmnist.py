"""FedCD against FedCD_basic, FedDistill, FedAvg and isolated training on real Fashion-MNIST: the shapes of
FedCD's Tables I-III (the paper's numbers are on CIFAR-100, another dataset; they are printed beside ours
as such).

Setting: the ``fedcd_fmnist`` preset (10 users, all active every round, 50 validation images per class
held out, shared batch 64, lambda=1, T=1, SGD lr 0.05 momentum 0.9 weight decay 1e-4, 10 local steps of
batch 32), ``--rounds`` rounds (30) evaluated every 2, IID and Dirichlet alpha=0.5, ``--seeds`` (0 1 2).
Methods:

- ``fedcd``: every user a different architecture (the preset's ten: lenet5, mlp, mobilenet_v3_small,
  resnet8, resnet8_bn, vgg_small, resnet14, resnet20, resnet32, resnet44);
- ``fedcd_basic``: every user resnet20 (FedCD_basic: one architecture);
- ``feddistill``: the ten architectures, per-label logits (Jeong et al. 2018);
- ``fedavg``: every user resnet20, parameter averaging (needs one architecture);
- ``local``: the ten architectures trained in isolation (Table I's "Individual" column: each on its user's
  shard);
- ``central``: each architecture alone on the **whole** training set (``data.partition=central``: one client
  holding every training image but the validation set; the same 10 steps of batch 32 a round, so the same
  samples seen as a FedCD user): the baseline Table I's gains are measured against in the paper. It does not
  depend on the split, so it runs once per architecture and seed (folders ``central_<architecture>_seed<k>``),
  evaluated after the last round only.

Setting ``alpha0.5_r100``: FedCD, FedCD_basic and FedAvg for 100 rounds at alpha = 0.5, seed 0 only (longer
runs, fewer seeds), evaluated every 10 rounds: whether FedAvg's lead is an effect of the short budget. On this
2-core CPU, one thread each, two at a time: FedCD 30 s a round (50 min), FedAvg 12 s (20 min); FedCD_basic,
1.3-1.7x FedCD's rounds in the 30-round grid, ~1-1.5 h. On one GPU, ~15 min for the three together (recorded
7.5-8.3 s a round, evaluating every 2 rounds, with 10-15 runs sharing an H200):

    python benchmarks/papers/fedcd_fmnist.py --device cuda --jobs 3 --settings alpha0.5_r100 --methods fedcd fedcd_basic fedavg

Every method trains on the same data (the validation images are held out for all). Accuracy is the mean
over users of their model's top-1 accuracy on the global test set (FedAvg: its global model), the last
evaluation and the mean of the last 5; AMP is on the users' own test splits. Table I's shape: each
architecture's accuracy under FedCD against the same user trained alone, from the final models. Table
III's shape: MB sent up and down until each run's best accuracy, and in all.

The grid runs through harness.py: runs (with ``clients.json``: each user's accuracies at the last
evaluation) in ``--runs-dir``, finished runs skipped, a stopped one resumed from its checkpoint, ``--jobs``
at a time; writes ``OUT/fedcd_fmnist.md`` and ``OUT/fedcd_fmnist.json`` (the record and every run's figures).

    .venv/bin/python benchmarks/papers/fedcd_fmnist.py --jobs 2                                  # CPU
    python benchmarks/papers/fedcd_fmnist.py --device cuda --jobs 8                              # one GPU, 8 processes
    .venv/bin/python benchmarks/papers/fedcd_fmnist.py --rounds 2 --seeds 0 --settings iid --out /tmp/s --runs-dir /tmp/s/runs
    .venv/bin/python benchmarks/papers/fedcd_fmnist.py --report-only                             # tables from finished runs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

import harness
from harness import LAST_N, Finished, Run
from harness import fmt_mean_std as mean_std

NAME = "fedcd_fmnist"
HOMOGENEOUS = "resnet20"
METHODS: dict[str, dict[str, Any]] = {
    "fedcd": {},
    "fedcd_basic": {"model.client_models": None},
    "feddistill": {"algorithm": {"name": "feddistill", "lambda_kd": 1.0, "temperature": 1.0}},
    "fedavg": {"algorithm": {"name": "fedavg"}, "model.client_models": None},
    "local": {"algorithm": {"name": "local"}},
}
SETTINGS: dict[str, dict[str, Any]] = {"iid": {"data.partition": "iid"},
                                       "alpha0.5": {"data.partition": "dirichlet", "data.alpha": 0.5},
                                       "alpha0.5_r100": {"data.partition": "dirichlet", "data.alpha": 0.5}}
LONG = {"setting": "alpha0.5_r100", "methods": ("fedcd", "fedcd_basic", "fedavg"), "seeds": (0,), "rounds": 100,
        "eval_every": 10}  # evaluating ten models costs several rounds' training on a CPU
CENTRAL = "central"  # a method of its own: one run per architecture and seed, whatever the settings
# FedCD paper, CIFAR-100 (another dataset): Table II average accuracy %, Table III MB (IID, 200 rounds).
PAPER_TABLE2 = {("fedavg", "iid"): 35.94, ("feddistill", "iid"): 34.85, ("fedcd", "iid"): 70.78,
                ("fedcd_basic", "iid"): 73.95, ("fedavg", "alpha0.5"): 35.88, ("feddistill", "alpha0.5"): 20.11,
                ("fedcd", "alpha0.5"): 42.92, ("fedcd_basic", "alpha0.5"): 44.51}
PAPER_TABLE3 = {"fedavg": 37928.40, "feddistill": 16.0, "fedcd": 10.24}
# Eq. 4's teacher and the uniform average scored on the shared batch gamma was fitted on (FITTED), and with last
# round's gamma on this round's batch, less the images the two batches share (HELDOUT)
FITTED = ("server/teacher_ce", "server/uniform_ce", "server/teacher_acc", "server/uniform_acc")
HELDOUT = tuple(f"{k}_heldout" for k in FITTED)


def architectures() -> list[str]:
    """The preset's ten architectures, user by user."""
    from fedray.load import load_config

    return list(load_config("fedcd_fmnist").model.client_models)


def planned(runs_dir: Path, methods, settings, seeds) -> list[Run]:
    """The runs asked for: methods x (iid, alpha0.5) x seeds; ``central`` once per architecture and seed; the
    100-round runs (LONG) of the asked methods at their seed."""
    runs = harness.plan(runs_dir, [m for m in methods if m in METHODS], [s for s in settings if s != LONG["setting"]],
                        seeds)
    if CENTRAL in methods:
        runs += harness.plan(runs_dir, [CENTRAL], architectures(), seeds)  # the architecture is the setting
    if LONG["setting"] in settings:
        runs += harness.plan(runs_dir, [m for m in LONG["methods"] if m in methods], [LONG["setting"]],
                             [s for s in LONG["seeds"] if s in seeds])
    return runs


def make_config(method: str, setting: str, seed: int, rounds: int, device: str, data_dir: str | None,
                eval_every: int = 2):
    from fedray.methods import validate_experiment
    from fedray.load import load_config, validate_config
    from fedray.overrides import apply_overrides

    raw = load_config("fedcd_fmnist").model_dump(mode="json")
    if method == CENTRAL:  # ``setting`` is the architecture
        spec: dict[str, Any] = {"algorithm": {"name": "local"}, "model.client_models": None, "data.partition": "central"}
        # Table I reads the final model; evaluating the whole test set and the 11,900-image local split every
        # few rounds would cost more than the training
        model, split, eval_every = setting, {}, rounds
    else:
        spec, model, split = dict(METHODS[method]), HOMOGENEOUS, SETTINGS[setting]
    if setting == LONG["setting"]:
        rounds, eval_every = LONG["rounds"], LONG["eval_every"]
    if "algorithm" in spec:
        raw["algorithm"] = spec.pop("algorithm")
    over = {"name": f"bench_{method}", "seed": seed, "federation.rounds": rounds, "federation.eval_every": eval_every,
            "model.name": model, "tracking.enabled": False, "runtime.backend": "local",
            "runtime.device": device, **split, **spec}
    if data_dir:
        over["data.data_dir"] = data_dir
    return validate_experiment(validate_config(apply_overrides(raw, over)))


def build(run: Run, opts: dict):
    return make_config(run.method, run.setting, run.seed, opts["rounds"], opts["device"], opts["data_dir"],
                       opts["eval_every"])


# --- collection -----------------------------------------------------------------------------------------------


def collect(grid: dict[tuple[str, str], list[Finished]]) -> dict:
    from fedray.record.run_dir import CLIENTS_FILE
    from fedray.report.table import bytes_to_round

    runs: dict[tuple[str, str], list[dict]] = {}
    for (method, setting), recs in grid.items():
        for f in recs:
            hist, summary, out = f.history, f.summary, f.run.out
            evald = [r for r in hist if r.get("eval/accuracy") is not None]
            best = max(evald, key=lambda r: r["eval/accuracy"]) if evald else None
            diag = {k: float(np.nanmean([r[k] for r in hist if r.get(k) is not None]))
                    for k in ("server/gamma_entropy", "server/gamma_max", "server/teacher_ce",
                              "server/uniform_ce", "server/teacher_acc", "server/uniform_acc", "server/gamma_gap")
                    if any(r.get(k) is not None for r in hist)}
            # fitted and held-out scores over the same rounds (round 1 has no earlier gamma to hold out)
            both = [r for r in hist if r.get(HELDOUT[0]) is not None]
            if both:
                diag["heldout"] = {k: float(np.mean([r[k] for r in both])) for k in FITTED + HELDOUT}
            runs.setdefault((method, setting), []).append({
                "seed": f.seed, "accuracy": summary["eval/accuracy"], "last_n": harness.last_n(hist),
                "amp": summary["eval/amp"], "best": best["eval/accuracy"] if best else None,
                "best_round": best["round"] if best else None,
                "mb_to_best": (bytes_to_round(hist, best["round"]) or 0) / 1e6 if best else None,
                "mb_total": (summary["comm/bytes_up"] + summary["comm/bytes_down"]) / 1e6,
                "mb_setup": summary.get("comm/bytes_setup", 0.0) / 1e6, "round_s": summary["time/round_s"],
                "runtime": summary.get("runtime", "?"),
                "curve": {str(r["round"]): r["eval/accuracy"] for r in evald},
                "clients": json.loads((out / CLIENTS_FILE).read_text()) if (out / CLIENTS_FILE).is_file() else [],
                "diagnostics": diag})
    return {f"{m}|{s}": v for (m, s), v in runs.items()}


def tables(res: dict, settings: list[str], meta: dict, runs_dir: Path, planned: list[Run]) -> str:
    lines = ["\n".join(harness.header("FedCD on Fashion-MNIST (FedCD Tables I-III in shape)", meta, NAME, runs_dir,
                                      planned))]
    lines += ["## Table II's shape: average user accuracy (%)\n",
              "Mean over users of their own model's top-1 accuracy on the global test set (FedAvg: the global "
              f"model), mean ± std over seeds; last evaluation / mean of the last {LAST_N} evaluations; AMP on the "
              "users' own test splits. Paper: CIFAR-100, 200 rounds (another dataset).\n",
              "| method | setting | seeds | accuracy | last 5 | AMP | paper (CIFAR-100) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for setting in settings:
        for method in METHODS:
            if setting == LONG["setting"] and method not in LONG["methods"]:
                continue
            rs = res.get(f"{method}|{setting}", [])
            paper = PAPER_TABLE2.get((method, setting))
            lines.append(f"| {method} | {setting} | {len(rs)} | {mean_std([r['accuracy'] for r in rs])} | "
                         f"{mean_std([r['last_n'] for r in rs])} | {mean_std([r['amp'] for r in rs])} | "
                         f"{paper if paper is not None else '—'} |")
    lines += ["\n## Table I's shape: each architecture under FedCD against the same architecture trained alone\n",
              "Final global-test accuracy (%) of each user's model, mean ± std over seeds. Isolated: the user's own "
              "shard (`local`); central: the whole training set (`central`, the paper's baseline), the same samples "
              "seen. Gains are FedCD minus the baseline, per seed.\n"]
    for setting in [s for s in settings if s != LONG["setting"]]:
        fed, alone = res.get(f"fedcd|{setting}", []), res.get(f"local|{setting}", [])
        lines += [f"### {setting}\n", "| user | architecture | isolated | central | FedCD | gain over isolated | "
                  "gain over central |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        by_seed = {r["seed"]: r for r in alone}
        users = sorted({c["client"] for r in fed for c in r["clients"]})
        for cid in users:
            arch = next(c for c in fed[0]["clients"] if c["client"] == cid)["architecture"]
            own = {r["seed"]: next(c for c in r["clients"] if c["client"] == cid)["global_accuracy"] for r in fed}
            iso = {s: next(c for c in r["clients"] if c["client"] == cid)["global_accuracy"] for s, r in by_seed.items()}
            cen = {r["seed"]: r["accuracy"] for r in res.get(f"{CENTRAL}|{arch}", [])}
            lines.append(f"| {cid} | {arch} | {mean_std(iso.values())} | {mean_std(cen.values())} | "
                         f"{mean_std(own.values())} | {mean_std(own[s] - iso[s] for s in own if s in iso)} | "
                         f"{mean_std(own[s] - cen[s] for s in own if s in cen)} |")
        lines.append("")
    lines += ["## Table III's shape: communication (MB, 10^6 bytes, up + down)\n",
              "To each run's best evaluated accuracy, and in all; setup = the validation images sent once to every "
              "user (FedCD only). Paper: CIFAR-100, IID, 200 rounds, one user's traffic.\n",
              "| method | setting | MB to best | best accuracy | MB in all | MB setup | paper MB |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for setting in settings:
        for method in METHODS:
            rs = res.get(f"{method}|{setting}", [])
            if not rs:
                continue
            paper = PAPER_TABLE3.get(method) if setting == "iid" else None
            lines.append(f"| {method} | {setting} | {np.mean([r['mb_to_best'] for r in rs]):,.3f} | "
                         f"{mean_std([r['best'] for r in rs])} | {np.mean([r['mb_total'] for r in rs]):,.3f} | "
                         f"{np.mean([r['mb_setup'] for r in rs]):,.2f} | {paper if paper is not None else '—'} |")
    lines += long_lines(res)
    lines += ["\n## FedCD's mechanism (means over rounds and seeds)\n",
              "| method | setting | gamma entropy (1 = uniform) | gamma max | teacher CE | uniform-average CE | teacher acc | uniform acc |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    held: list[str] = []
    for setting in settings:
        for method in ("fedcd", "fedcd_basic"):
            rs = res.get(f"{method}|{setting}", [])
            if not rs:
                continue
            d = lambda k: np.mean([r["diagnostics"].get(k, np.nan) for r in rs])  # noqa: E731
            lines.append(f"| {method} | {setting} | {d('server/gamma_entropy'):.3f} | {d('server/gamma_max'):.3f} | "
                         f"{d('server/teacher_ce'):.3f} | {d('server/uniform_ce'):.3f} | {d('server/teacher_acc'):.3f} | "
                         f"{d('server/uniform_acc'):.3f} |")
            hs = [r["diagnostics"]["heldout"] for r in rs if "heldout" in r["diagnostics"]]
            if hs:
                m = {k: np.mean([h[k] for h in hs]) for k in FITTED + HELDOUT}
                held.append(f"| {method} | {setting} | {len(hs)} | " + " | ".join(
                    f"{m[k]:.3f} / {m[k + '_heldout']:.3f}" for k in FITTED) + " |")
    if held:
        lines += ["\nDoes Eq. 4's teacher beat the uniform average on images gamma was not fitted on? Fitted: on the 64 "
                  "shared images gamma was fitted on; held out: last round's gamma on this round's shared batch, less "
                  "the images the two batches share; both over the rounds that have the held-out score (from round 2), "
                  "in the runs that have it (made since the score exists).\n",
                  "| method | setting | runs | teacher CE, fitted / held out | uniform CE | teacher acc | uniform acc |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |", *held]
    lines += ["\n## Where each run ran\n",
              "Runs of one table may come from different devices (float rounding differs, the method does not); "
              "a run's s/round (in brackets) is comparable only with runs of one device and one sharing of it.\n",
              "| runtime | runs (s/round) |", "| --- | --- |"]
    where: dict[str, list[str]] = {}
    for key, rs in sorted(res.items()):
        for r in rs:
            run = f"{key.replace('|', ' ')} s{r['seed']} ({r['round_s']:.1f})"
            where.setdefault(r.get("runtime", "?"), []).append(run)
    lines += [f"| {rt} | {', '.join(names)} |" for rt, names in sorted(where.items())]
    return "\n".join(lines) + "\n"


def long_lines(res: dict) -> list[str]:
    """FedAvg's lead over FedCD and FedCD_basic as rounds go on: in the 30-round grid (mean over seeds) and in
    the 100-round runs."""
    lines = ["\n## Is FedAvg's lead a short-budget effect? (α = 0.5)\n",
             "Global-test accuracy (%) at evaluated rounds, mean over the runs' seeds; lead = FedAvg minus the "
             "method at that round.\n", "| runs | method | seeds | " + " | ".join(f"round {k}" for k in (10, 20, 30, 50, 100))
             + " |", "| --- | --- | ---: | " + " | ".join("---:" for _ in range(5)) + " |"]
    for setting, label in (("alpha0.5", "30 rounds"), (LONG["setting"], f"{LONG['rounds']} rounds")):
        curves = {m: res.get(f"{m}|{setting}", []) for m in LONG["methods"]}
        if not curves["fedavg"]:
            continue
        at = {m: {k: np.mean([r["curve"].get(str(k), np.nan) for r in rs]) for k in (10, 20, 30, 50, 100)}
              for m, rs in curves.items() if rs}
        for m in at:
            cells = [f"{100 * at[m][k]:.2f}" + ("" if m == "fedavg" or np.isnan(at[m][k] - at["fedavg"][k])
                                               else f" (lead {100 * (at['fedavg'][k] - at[m][k]):+.2f})")
                     if not np.isnan(at[m][k]) else "—" for k in (10, 20, 30, 50, 100)]
            lines.append(f"| {label} | {m} | {len(curves[m])} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.grid_args(ap, NAME, [*METHODS, CENTRAL], list(SETTINGS), rounds=30)
    ap.add_argument("--eval-every", type=int, default=2, help="evaluating 10 models on the test set is the "
                    "costliest part of a round")
    ap.add_argument("--data-dir")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    opts = {"rounds": args.rounds, "device": args.device, "data_dir": args.data_dir, "eval_every": args.eval_every,
            "threads": args.threads, "keep_models": args.keep_models}
    meta = harness.run_and_record(NAME, argv, args, build, planned(args.runs_dir, args.methods, args.settings,
                                                                   args.seeds), opts)
    table_runs = planned(args.runs_dir, ap.get_default("methods"), ap.get_default("settings"),
                         sorted({*ap.get_default("seeds"), *args.seeds}))
    res = collect(harness.collect(table_runs))
    md = tables(res, list(SETTINGS), meta, args.runs_dir, table_runs)
    harness.write(args.out, NAME, meta, {"runs": res}, md)
    print(md)


if __name__ == "__main__":
    main()
