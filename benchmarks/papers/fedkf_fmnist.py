"""FedKF's comparison (Tables V-VIII, XII) on real Fashion-MNIST: FedAvg, FedProx, FedGen, q-FFL, FedGKD, FedKF- and
FedKF (each with its ACA and OCA model), and FedAvg vs FedAvg (OCA).

Setting (FedKF Sec. VI-A, its EMNIST / LeNet-5 column): K = 20 clients, Dirichlet alpha in {1, 0.1, 0.01},
4 clients per round (C = 0.2), LeNet-5, batch 64, SGD lr 0.01 without momentum, generator Adam 1e-3,
gamma = 1, lambda1 = lambda2 = 0.1; baselines at the values FedKF tuned for EMNIST (FedProx mu = 1e-3,
FedGKD gamma = 1e-3 with M = 5, q-FFL q = 1e-4; FedGen at its authors' MNIST settings, alpha = beta scaled to
the lr). AMP / FM / WLP are FedKF Def. 1-3 on the clients' 80/20 test splits. The paper ran 100 rounds of
E = 10 local epochs on a GPU; rounds and local work are flags here.

Defaults (the recorded grid), sized for a 2-core CPU with one torch thread: 20 rounds of 16 local steps
(batch 64) at SGD lr 0.05, FedKF generating 16 samples per step, evaluation every 2 rounds, seeds 0 1 2.
Why: FedKF's local generator costs ~0.56 s per step at 64 generated samples on one core (a FedAvg step
costs 10 ms), so the paper's budget would take days here; 16 samples per step cut it to ~0.13 s. 16 steps
at lr 0.05 keep each round's local progress (lr x steps = 0.8) equal to the paper's EMNIST setting (10
epochs of ~8 batches at lr 0.01), so the client drift FedKF addresses is of the same order. Evaluating a
model on the 10,000 test images and the clients' test splits costs ~1.3 s (3 models for the cached
methods), hence every 2 rounds. ``--local-epochs 10 --lr 0.01 --generator-batch 64 --rounds 100
--eval-every 1`` is the paper's setting.

One FedAvg run with ``report_model=oca`` gives both FedAvg rows: its ACA model is plain FedAvg (the training
is identical; tests/methods/test_fedkf.py checks it bit for bit) and its OCA model is "FedAvg (OCA)".
Likewise one FedKF run gives FedKF (ACA) and FedKF (OCA).

Collapse to chance: a run whose final global-test accuracy is within a point of 1/10 predicts one class; the
tables mark it. At alpha = 0.01 FedAvg and the baselines built on its local step do this in seed 0, so the
script then chooses their lr on held-out images, never on the test set: FedAvg at alpha = 0.01 with
``data.val_per_class`` = 50 (500 training images no client holds), at each of LR_CHOICES, the grid's seeds;
the lr with the best mean over seeds of the last-5 ``val/accuracy`` is chosen, and every baseline with a
collapsed run is rerun with it on the grid's own split (rows "..., lr X (chosen on val)"); when the choice is
the grid's own lr, the grid's runs are those reruns. FedProx, FedGKD and FedGen take FedAvg's choice: their
extra terms are small beside its local step.

The grid (harness.py): methods x settings (alpha1, alpha0.1, alpha0.01) x seeds, one run folder each in
``--runs-dir`` (default benchmarks/results/fedkf_fmnist_runs); finished runs are skipped, so an interrupted
benchmark continues where it stopped. Dirichlet alpha = 0.01 over 20 clients cannot always give every client
data.min_samples = 10 (it depends on the seed): a run then lowers min_samples to 5, then 2 (its config.yaml
keeps what it used). Cost on the 2-core CPU, one thread: ~1.5 s of CPU a round for the four baselines,
~8 s for FedKF and FedKF- (36 runs of 20 rounds: ~45 min of CPU).

    .venv/bin/python benchmarks/papers/fedkf_fmnist.py --rounds 2 --seeds 0 --settings alpha0.1 \
        --out /tmp/fk --runs-dir /tmp/fk/runs                                       # smoke
    nice -n 10 .venv/bin/python benchmarks/papers/fedkf_fmnist.py                  # the recorded grid
    .venv/bin/python benchmarks/papers/fedkf_fmnist.py --report-only                # tables from the runs
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

import harness
from harness import Finished, Run, fmt_mean_std

NAME = "fedkf_fmnist"
METHODS: dict[str, dict] = {
    "fedavg": {"algorithm.name": "fedavg", "algorithm.report_model": "oca"},
    "fedprox": {"algorithm.name": "fedprox", "algorithm.mu": 0.001},
    # SCAFFOLD (option II, eta_g = 1) on the grid's plain SGD: not in FedKF's paper, beside FedAvg and FedProx here
    "scaffold": {"algorithm.name": "scaffold"},
    "qffl": {"algorithm.name": "qffl", "algorithm.q": 0.0001},
    # FedGen with its authors' MNIST settings (fedray's defaults), but alpha = beta = 2: they ran SGD at lr 0.01 with
    # alpha = beta = 10; at this grid's lr 0.05 the weight 2 keeps the terms' step (lr x weight) at their 0.1
    "fedgen": {"algorithm.name": "fedgen", "algorithm.alpha": 2.0, "algorithm.beta": 2.0},
    "fedgkd": {"algorithm.name": "fedgkd", "algorithm.gamma": 0.001, "algorithm.buffer_size": 5},
    "fedkf_minus": {"algorithm.name": "fedkf", "algorithm.variant": "fedkf-"},
    "fedkf": {"algorithm.name": "fedkf", "algorithm.variant": "fedkf"},
}
SETTINGS = {"alpha1": 1.0, "alpha0.1": 0.1, "alpha0.01": 0.01}
CHANCE = 0.1  # 10 classes
LR_CHOICES = (0.005, 0.01, 0.02, 0.05)  # the lr choice for collapsed baselines (the grid's lr is the last)
VAL_PER_CLASS = 50
SELECT_SETTING = "alpha0.01val"  # the choice's runs: alpha 0.01 with a validation set
BASELINES = ("fedavg", "fedprox", "scaffold", "fedgen", "fedgkd", "qffl")
# table row -> (method run, suffix of the eval keys that hold that row's model)
ROWS = [
    ("FedAvg", "fedavg", "_aca"), ("FedProx", "fedprox", ""), ("SCAFFOLD", "scaffold", ""), ("FedGen", "fedgen", ""),
    ("FedGKD", "fedgkd", ""),
    ("q-FFL", "qffl", ""),
    ("FedKF- (ACA)", "fedkf_minus", "_aca"), ("FedKF- (OCA)", "fedkf_minus", "_oca"),
    ("FedKF (ACA)", "fedkf", "_aca"), ("FedKF (OCA)", "fedkf", "_oca"),
]
XII_ROWS = [("FedAvg", "fedavg", "_aca"), ("FedAvg (OCA)", "fedavg", "_oca")]

# The paper's numbers (EMNIST-letters 10% subset with LeNet-5, and CIFAR-10 with ResNet-8; NOT Fashion-MNIST):
# (AMP %, FM x10^-3, WLP %), FM converted to x10^-3 where the paper printed x10^-2.
PAPER = {
    "EMNIST": {
        1.0: {"FedAvg": (83.78, 1.477, 76.46), "FedProx": (83.87, 2.008, 75.24), "FedGen": (84.81, 1.379, 78.25),
              "FedGKD": (83.63, 1.463, 74.78),
              "q-FFL": (84.07, 1.729, 76.58), "FedKF- (ACA)": (85.18, 1.064, 78.38),
              "FedKF- (OCA)": (85.26, 1.211, 78.35), "FedKF (ACA)": (85.54, 1.717, 77.39),
              "FedKF (OCA)": (85.46, 1.540, 78.26)},
        0.1: {"FedAvg": (75.61, 7.972, 57.07), "FedProx": (75.59, 7.844, 56.75), "FedGen": (77.37, 5.405, 61.20),
              "FedGKD": (75.93, 6.477, 56.02),
              "q-FFL": (75.67, 6.740, 57.25), "FedKF- (ACA)": (82.82, 2.753, 72.71),
              "FedKF- (OCA)": (83.36, 2.358, 73.76), "FedKF (ACA)": (82.76, 3.049, 72.41),
              "FedKF (OCA)": (82.94, 2.978, 71.53), "FedAvg (OCA)": (78.38, 5.329, 60.88)},
        0.01: {"FedAvg": (55.42, 48.71, 5.61), "FedProx": (55.70, 65.35, 3.96), "FedGen": (56.07, 59.51, 9.08),
               "FedGKD": (57.86, 42.66, 7.92),
               "q-FFL": (54.90, 31.28, 18.70), "FedKF- (ACA)": (74.44, 16.67, 39.92),
               "FedKF- (OCA)": (76.20, 12.83, 41.91), "FedKF (ACA)": (72.33, 21.53, 38.12),
               "FedKF (OCA)": (72.73, 27.80, 36.73)},
    },
    "CIFAR-10": {
        1.0: {"FedAvg": (74.28, 1.014, 68.23), "FedProx": (74.00, 1.079, 67.87), "FedGen": (74.52, 0.778, 68.56),
              "FedGKD": (74.83, 0.786, 69.40),
              "q-FFL": (73.96, 0.716, 68.59), "FedKF- (ACA)": (75.19, 0.737, 70.14),
              "FedKF- (OCA)": (75.62, 1.150, 69.13), "FedKF (ACA)": (75.23, 0.971, 69.68),
              "FedKF (OCA)": (75.54, 1.197, 69.03)},
        0.1: {"FedAvg": (61.89, 18.07, 34.41), "FedProx": (62.25, 17.64, 36.09), "FedGen": (62.92, 19.16, 34.00),
              "FedGKD": (63.98, 15.08, 40.04),
              "q-FFL": (61.49, 18.53, 33.02), "FedKF- (ACA)": (67.97, 13.33, 47.72),
              "FedKF- (OCA)": (69.88, 8.74, 53.89), "FedKF (ACA)": (67.86, 12.71, 45.12),
              "FedKF (OCA)": (70.11, 8.35, 55.18), "FedAvg (OCA)": (65.82, 11.94, 44.21)},
        0.01: {"FedAvg": (38.48, 79.14, 1.82), "FedProx": (38.30, 79.79, 1.24), "FedGen": (40.34, 66.73, 2.63),
               "FedGKD": (39.14, 54.78, 2.40),
               "q-FFL": (37.75, 36.55, 1.26), "FedKF- (ACA)": (47.98, 55.76, 3.96),
               "FedKF- (OCA)": (54.41, 30.63, 26.09), "FedKF (ACA)": (47.89, 58.17, 5.68),
               "FedKF (OCA)": (54.74, 27.92, 29.86)},
    },
}
# Table VIII (alpha = 0.1): rounds to reach FedAvg's AMP after 100 rounds ("> 100" = never).
PAPER_ROUNDS = {
    "EMNIST": {"FedAvg": "100", "FedProx": ">100", "FedGen": "77", "FedGKD": ">100", "q-FFL": "100",
               "FedKF- (ACA)": "31", "FedKF- (OCA)": "31", "FedKF (ACA)": "31", "FedKF (OCA)": "32"},
    "CIFAR-10": {"FedAvg": "100", "FedProx": "98", "FedGen": "91", "FedGKD": "49", "q-FFL": ">100",
                 "FedKF- (ACA)": "35", "FedKF- (OCA)": "30", "FedKF (ACA)": "34", "FedKF (OCA)": "28"},
}


def base_overrides(opts: dict) -> dict:
    over = {
        "name": "fedkf_fmnist", "data.dataset": "fashion_mnist", "data.partition": "dirichlet",
        "data.num_clients": 20, "model.name": "lenet5", "federation.rounds": opts["rounds"],
        "federation.clients_per_round": 4, "federation.batch_size": opts["batch_size"], "federation.lr": opts["lr"],
        "federation.momentum": 0.0, "federation.weight_decay": 0.0, "federation.eval_every": opts["eval_every"],
        "federation.eval_batch_size": 256,  # 2x faster than 1024 for LeNet-5 on a CPU; same predictions
        "runtime.backend": "local", "runtime.num_cpus_per_worker": opts["threads"], "runtime.device": opts["device"],
        "tracking.enabled": False,
    }
    if opts["local_epochs"] is not None:
        over["federation.local_epochs"] = opts["local_epochs"]
    else:
        over.update({"federation.local_steps": opts["local_steps"], "federation.local_epochs": None})
    return over


def method_overrides(opts: dict, method: str) -> dict:
    over = dict(METHODS[method])
    if over["algorithm.name"] == "fedkf":
        over["algorithm.generator_batch_size"] = opts["generator_batch"]
    return over


def lr_method(method: str, lr: float) -> str:
    """The name of ``method``'s runs at learning rate ``lr`` (the lr choice and the reruns)."""
    return f"{method}_lr{lr:g}"


def split_method(name: str) -> tuple[str, float | None]:
    """``fedavg_lr0.01`` -> ("fedavg", 0.01); a grid method -> (it, None)."""
    base, sep, lr = name.rpartition("_lr")
    return (base, float(lr)) if sep and base in METHODS else (name, None)


def build(run: Run, opts: dict):
    """The run's config and data: the partition of (alpha, seed), data.min_samples lowered from 10 to 5, then
    2, when alpha is too small for it. The lr choice's runs are plain FedAvg with a validation set."""
    from fedray.load import load_config
    from fedray.data import build_federated_data
    from fedray.errors import DataError

    method, lr = split_method(run.method)
    select = run.setting == SELECT_SETTING
    over = {**base_overrides(opts), "data.alpha": SETTINGS["alpha0.01" if select else run.setting], "seed": run.seed,
            **({"algorithm.name": "fedavg", "data.val_per_class": VAL_PER_CLASS} if select
               else method_overrides(opts, method)),
            **({} if lr is None else {"federation.lr": lr})}
    for min_samples in (10, 5, 2):
        cfg = load_config(None, {**over, "data.min_samples": min_samples})
        try:
            return cfg, build_federated_data(cfg.data, cfg.seed)
        except DataError as e:
            if "min_samples" not in str(e.key):
                raise
            print(f"  {run.out.name}: data.min_samples={min_samples} impossible, trying lower", flush=True)
    raise SystemExit(f"{run.out.name}: no partition even with data.min_samples=2")


def collapsed(rec: Finished, suffix: str) -> bool:
    """The run's model (``suffix``: its ACA / OCA keys) ended within a point of chance: it predicts one class."""
    return rec.summary[f"eval/accuracy{suffix}"] < CHANCE + 0.01


def selection_runs(runs_dir: Path, seeds) -> list[Run]:
    return harness.plan(runs_dir, [lr_method("fedavg", lr) for lr in LR_CHOICES], [SELECT_SETTING], seeds)


def chosen_lr(runs_dir: Path, seeds) -> tuple[float | None, dict[float, list[float]]]:
    """The lr of LR_CHOICES with the best mean over seeds of FedAvg's last-5 ``val/accuracy`` at alpha = 0.01
    (None until every run of the choice has finished), and every lr's per-seed scores."""
    grid = harness.collect(selection_runs(runs_dir, seeds))
    scores = {split_method(m)[1]: [harness.last_n(r.history, "val/accuracy") for r in recs]
              for (m, _), recs in grid.items()}
    if len(scores) < len(LR_CHOICES) or any(len(v) < len(seeds) for v in scores.values()):
        return None, scores
    return max(LR_CHOICES, key=lambda lr: float(np.mean(scores[lr]))), scores


def later_runs(runs_dir: Path, seeds, grid_lr: float) -> list[Run]:
    """The lr choice's runs, and once they have finished, every baseline with a run collapsed to chance at
    alpha = 0.01 rerun on the grid's split at the chosen lr (none when the choice is the grid's own lr)."""
    runs = selection_runs(runs_dir, seeds)
    lr, _ = chosen_lr(runs_dir, seeds)
    if lr is None or lr == grid_lr:
        return runs
    done = harness.collect(harness.plan(runs_dir, BASELINES, ["alpha0.01"], seeds))
    suffix = {method: sfx for _, method, sfx in ROWS}
    bad = [m for m in BASELINES if any(collapsed(r, suffix[m]) for r in done.get((m, "alpha0.01"), []))]
    return runs + harness.plan(runs_dir, [lr_method(m, lr) for m in bad], ["alpha0.01"], seeds)


# ---------------------------------------------------------------------------------------------------
# tables


def first_round(history, key, target):
    for row in history:
        v = row.get(key)
        if v is not None and not math.isnan(v) and v >= target - 1e-12:
            return int(row["round"])
    return None


def row_figures(recs: list[Finished], suffix: str) -> dict:
    """One table row's figures, per seed: the final AMP / FM / WLP / accuracy, the mean AMP of the last 5
    evaluations, and the seeds whose run collapsed to chance."""
    return {"seeds": [r.seed for r in recs],
            **{m: [r.summary[f"eval/{m}{suffix}"] for r in recs] for m in ("amp", "fm", "wlp", "accuracy")},
            "amp_last5": [harness.last_n(r.history, f"eval/amp{suffix}") for r in recs],
            "collapsed": [r.seed for r in recs if collapsed(r, suffix)]}


def tabulate(grid: dict[tuple[str, str], list[Finished]], settings: list[str], later: dict) -> dict:
    """The tables' figures, per seed: Tables V-VI's rows (with the reruns of collapsed baselines at the lr
    chosen on validation images), Table XII's, Table VIII's rounds, the timing, the lr choice."""
    out: dict = {"rows": {}, "xii": {}, "rounds": {}, "timing": {}, "min_samples": {}, "lr_choice": {}}
    for setting in settings:
        a = f"{SETTINGS[setting]:g}"
        for table, rows in (("rows", ROWS), ("xii", XII_ROWS)):
            out[table][a] = {}
            for label, method, suffix in rows:
                recs = grid.get((method, setting), [])
                if recs:
                    out[table][a][label] = row_figures(recs, suffix)
                    if table == "rows":
                        for (m, s), reruns in later.items():
                            base, lr = split_method(m)
                            if s == setting and base == method:
                                out[table][a][f"{label}, lr {lr:g} (chosen on val)"] = row_figures(reruns, suffix)
        # Table VIII: rounds each row needs to reach FedAvg's final AMP, per seed
        out["rounds"][a] = {}
        base = {r.seed: r for r in grid.get(("fedavg", setting), [])}
        for label, method, suffix in ROWS + XII_ROWS[1:]:
            per_seed = [first_round(r.history, f"eval/amp{suffix}", base[r.seed].summary["eval/amp_aca"])
                        for r in grid.get((method, setting), []) if r.seed in base]
            if per_seed:
                out["rounds"][a][label] = per_seed
        for recs in grid.values():
            for r in recs:
                if r.run.setting == setting:
                    out["min_samples"][f"{a}/{r.seed}"] = r.params.get("data.min_samples")
    for method in METHODS:
        recs = [r for (m, s), rs in grid.items() if m == method and s in settings for r in rs]
        if recs:
            steady = [float(np.mean([row["time/round_s"] for row in r.history[1:]] or [math.nan])) for r in recs]
            out["timing"][method] = {"mean_round_s": float(np.mean([r.summary["time/round_s"] for r in recs])),
                                     "steady_round_s": float(np.nanmean(steady)),
                                     "total_s": float(sum(r.summary["time/total_s"] for r in recs))}
    return out


def rounds_cell(per_seed, rounds):
    hits = [r for r in per_seed if r is not None]
    if not hits:
        return f">{rounds}"
    text = f"{np.mean(hits):.1f}".rstrip("0").rstrip(".")
    return text if len(hits) == len(per_seed) else f"{text} ({len(hits)}/{len(per_seed)} reached, others >{rounds})"


def _paper(t) -> str:
    return "—" if t is None else f"{t[0]:.2f} / {t[1]:.3f} / {t[2]:.2f}"


def marked(label: str, row: dict) -> str:
    """The row's label, with † and the seeds that collapsed to chance."""
    bad = row["collapsed"]
    return f"{label} † (seed{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))})" if bad else label


def lr_choice_lines(choice: dict, grid_lr: float) -> list[str]:
    """The lr choice for the collapsed baselines: each lr's validation score and the one chosen."""
    if not choice.get("scores"):
        return []
    lines = ["## The learning rate for collapsed baselines, chosen on validation images", "",
             f"FedAvg at α = 0.01 with {VAL_PER_CLASS} training images per class held out as a validation set "
             "(no client holds them), one run per lr and seed; the score is the mean `val/accuracy` of the last 5 "
             f"evaluations (%). The test set plays no part. The grid's lr is {grid_lr:g}.", "",
             "| lr | val accuracy, last 5 (%) | seeds |", "| ---: | ---: | ---: |"]
    for lr, scores in choice["scores"].items():
        pick = " (chosen)" if choice["chosen"] is not None and float(lr) == choice["chosen"] else ""
        lines.append(f"| {float(lr):g}{pick} | {fmt_mean_std(scores, 100, 2)} | {len(scores)} |")
    if choice["chosen"] is None:
        lines.append("\nNot every run of the choice has finished: no lr is chosen yet.")
    elif choice["chosen"] == grid_lr:
        lines.append("\nThe choice is the grid's own lr: nothing is rerun.")
    else:
        lines.append(f"\nEvery baseline with a collapsed run at α = 0.01 is rerun with lr {choice['chosen']:g} on the "
                     "grid's split and seeds (the rows \"..., chosen on val\" above).")
    return lines + [""]


def markdown(res: dict, meta: dict, setting: dict, runs_dir: Path, planned: list[Run]) -> str:
    rounds = setting["rounds"]
    lines = harness.header("FedKF comparison on Fashion-MNIST", meta, NAME, runs_dir, planned)
    lines += [
        "**Our numbers are Fashion-MNIST (LeNet-5, K = 20, 4 clients per round, batch "
        f"{setting['batch_size']}, {setting['local_work']}, {rounds} rounds, seeds {setting['seeds']}).** "
        "The paper's columns are its own numbers on **EMNIST-letters (10 % subset, LeNet-5)** and **CIFAR-10 "
        "(ResNet-8)** after 100 rounds of 10 local epochs (Tables V, VI, VIII, XII): a different dataset, budget "
        "and hardware, shown for the shape of the comparison, not as a target to match digit for digit.",
        "",
        "AMP / WLP in %, FM = population variance of per-client accuracy in fraction² ×10⁻³ (FedKF's unit; the "
        "paper's ×10⁻² columns are converted). Mean ± sample std over seeds, after the last round; \"AMP, last 5\" "
        "is the mean AMP of the last 5 evaluations, the figure to compare methods by. FedAvg's row is the ACA "
        "model of the FedAvg (OCA) run (identical training); FedKF rows of one variant come from one run. "
        "† marks a row with runs that collapsed to chance (final global-test accuracy within a point of 10 %: "
        "one class predicted), naming their seeds.",
        "",
    ]
    if res["min_samples"]:
        lowered = {k: v for k, v in res["min_samples"].items() if v != 10}
        lines.append("data.min_samples: 10" + (f", lowered where the Dirichlet draw could not reach it: "
                                                f"{', '.join(f'alpha/seed {k} -> {v}' for k, v in lowered.items())}"
                                                if lowered else " for every partition") + ".")
        lines.append("")
    for a in res["rows"]:
        alpha = float(a)
        lines += [f"## α = {a}", "",
                  "| method | AMP (%) | AMP, last 5 (%) | FM (×10⁻³) | WLP (%) | paper EMNIST AMP / FM / WLP "
                  "| paper CIFAR-10 AMP / FM / WLP |",
                  "| :--- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for label, r in res["rows"][a].items():
            pe, pc = PAPER["EMNIST"].get(alpha, {}).get(label), PAPER["CIFAR-10"].get(alpha, {}).get(label)
            lines.append(f"| {marked(label, r)} | {fmt_mean_std(r['amp'], 100, 2)} | "
                         f"{fmt_mean_std(r['amp_last5'], 100, 2)} | {fmt_mean_std(r['fm'], 1e3, 3)} | "
                         f"{fmt_mean_std(r['wlp'], 100, 2)} | {_paper(pe)} | {_paper(pc)} |")
        lines.append("")
    lines += lr_choice_lines(res["lr_choice"], setting["lr"])
    lines += ["## FedAvg vs FedAvg (OCA) (Table XII)", "",
              "| α | method | AMP (%) | FM (×10⁻³) | WLP (%) | paper EMNIST (α=0.1) | paper CIFAR-10 (α=0.1) |",
              "| :--- | :--- | ---: | ---: | ---: | ---: | ---: |"]
    for a, rows in res["xii"].items():
        for label, *_ in XII_ROWS:
            r = rows.get(label)
            if r is None:
                continue
            pe, pc = PAPER["EMNIST"][0.1].get(label), PAPER["CIFAR-10"][0.1].get(label)
            lines.append(f"| {a} | {marked(label, r)} | {fmt_mean_std(r['amp'], 100, 2)} | {fmt_mean_std(r['fm'], 1e3, 3)} | "
                         f"{fmt_mean_std(r['wlp'], 100, 2)} | {_paper(pe)} | {_paper(pc)} |")
    lines += ["", "## Rounds to reach FedAvg's final AMP (Table VIII)", "",
              f"Per seed, the target is that seed's FedAvg AMP after {rounds} rounds; the first round whose AMP "
              "reaches it, mean over seeds; speedup = FedAvg's rounds / the method's. The paper's target is FedAvg "
              "after 100 rounds at α = 0.1.", ""]
    alphas = list(res["rounds"])
    lines.append("| method | " + " | ".join(f"α = {a}: rounds (speedup)" for a in alphas)
                 + " | paper EMNIST | paper CIFAR-10 |")
    lines.append("| :--- | " + " | ".join("---:" for _ in alphas) + " | ---: | ---: |")
    for label, *_ in ROWS + XII_ROWS[1:]:
        cells = []
        for a in alphas:
            per_seed = res["rounds"][a].get(label)
            if per_seed is None:
                cells.append("—")
                continue
            hits = [r for r in per_seed if r is not None]
            speed = f" ({rounds / np.mean(hits):.1f}×)" if hits and len(hits) == len(per_seed) else ""
            cells.append(rounds_cell(per_seed, rounds) + speed)
        pe, pc = PAPER_ROUNDS["EMNIST"].get(label, "—"), PAPER_ROUNDS["CIFAR-10"].get(label, "—")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {pe} | {pc} |")
    lines += ["", "## Time per round", "",
              "Means over every run of the method, whatever else shared the CPU (the record above says which "
              "invocations shared it): a guide to the cost, not a speed measurement.", "",
              "| method | s/round (mean, incl. evaluation) | s/round from round 2 | total s |",
              "| :--- | ---: | ---: | ---: |"]
    for method, t in res["timing"].items():
        lines.append(f"| {method} | {t['mean_round_s']:.2f} | {t['steady_round_s']:.2f} | {t['total_s']:.0f} |")
    lines.append("")
    return "\n".join(lines)


def setting_of(grid: dict[tuple[str, str], list[Finished]]) -> dict:
    """The budget the tables describe, read from a run's config (all runs of the grid share it)."""
    any_run = next(r for recs in grid.values() for r in recs)
    p = any_run.params
    local = (f"E = {p['federation.local_epochs']} local epoch(s) per round" if p.get("federation.local_epochs")
             else f"{p['federation.local_steps']} local steps per round")
    gen = next((r.params.get("algorithm.generator_batch_size") for recs in grid.values() for r in recs
                if r.params.get("algorithm.name") == "fedkf"), None)
    local += (f", SGD lr {p['federation.lr']:g}" + (f", FedKF {gen} generated samples per step" if gen else "")
              + f", evaluated every {p['federation.eval_every']} round(s)")
    seeds = sorted({r.seed for recs in grid.values() for r in recs})
    return {"rounds": p["federation.rounds"], "batch_size": p["federation.batch_size"], "local_work": local,
            "seeds": ", ".join(map(str, seeds)), "lr": p["federation.lr"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.grid_args(ap, NAME, list(METHODS), list(SETTINGS), rounds=20)
    ap.add_argument("--local-epochs", type=int, default=None,
                    help="passes over each client's data per round (the paper: 10); overrides --local-steps")
    ap.add_argument("--local-steps", type=int, default=16, help="optimizer steps per client per round")
    ap.add_argument("--lr", type=float, default=0.05, help="local SGD learning rate (the paper: 0.01 with E=10)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--generator-batch", type=int, default=16,
                    help="FedKF's generated samples per local step (the paper: the batch size, 64)")
    ap.add_argument("--eval-every", type=int, default=2, help="evaluate every N rounds (and after the last)")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    opts = {k: getattr(args, k) for k in ("rounds", "local_epochs", "local_steps", "lr", "batch_size",
                                          "generator_batch", "eval_every", "threads", "device", "keep_models")}
    table_runs = harness.tabled(ap, args)
    seeds = sorted({r.seed for r in table_runs})
    # the lr choice (every seed of the tables) and the reruns, when FedAvg at alpha = 0.01 is asked for
    then = ((lambda: later_runs(args.runs_dir, seeds, args.lr))
            if "alpha0.01" in args.settings and "fedavg" in args.methods else None)
    meta = harness.run_and_record(NAME, argv, args, build, harness.plan(args.runs_dir, args.methods, args.settings,
                                                                        args.seeds), opts, then)
    extra = later_runs(args.runs_dir, seeds, args.lr)
    grid = harness.collect(table_runs)
    if not grid:
        raise SystemExit(f"no finished run in {args.runs_dir}")
    res = tabulate(grid, list(SETTINGS), harness.collect(r for r in extra if r.setting != SELECT_SETTING))
    lr, scores = chosen_lr(args.runs_dir, seeds)
    res["lr_choice"] = {"chosen": lr, "scores": {f"{k:g}": v for k, v in sorted(scores.items())}}
    md = markdown(res, meta, setting_of(grid), args.runs_dir, table_runs + extra)
    harness.write(args.out, NAME, meta, {"results": res, "paper": {
        "tables_V_VI_XII": {d: {str(a): v for a, v in t.items()} for d, t in PAPER.items()},
        "table_VIII": PAPER_ROUNDS}}, md)
    print(md)


if __name__ == "__main__":
    main()
