"""DaFKD's Table 1 on real Fashion-MNIST: FedAvg, FedProx, FedDF, FedGen, FedFTG and DaFKD, with DaFKD's two
ablations (Tables 1-3).

Setting (``--preset``, default ``dafkd_fmnist``: the paper's Sec. 4.1 at a reduced budget a CPU allows): K=20
clients, 8 per round, Dirichlet alpha in {0.1, 1.0} (``--settings alpha0.1 alpha1``), 20 local steps of
batch 32, 60 rounds, LeNet-5, Adam lr 1e-3 and weight decay 1e-3 for every method's local training; DaFKD with
a width-16 DCGAN generator. ``--local-epochs N`` / ``--local-steps N`` set every method's local budget (the
paper: 20 epochs); ``--preset dafkd_resnet11 --device cuda --runs-dir runs/dafkd_resnet11`` is the paper's
setting on a GPU. Methods: ``fedavg``, ``fedprox`` (mu = 0.01), ``feddf`` (the paper's FedDFusion: FedDF on
unlabelled training samples as proxy data, 500 a class, copied so that the clients' data is FedAvg's),
``fedgen`` and ``fedftg`` (their presets' algorithm sections: the authors' settings, FedFTG's generator at width
16), ``dafkd``, ``dafkd_no_sharing`` (Table 3: separate discriminator), ``dafkd_no_correlation`` (Table 3:
uniform weights). DaFKD and FedFTG runs also evaluate the plain average before their server step
(``eval/accuracy_avg``), to show what the distillation / fine-tuning itself adds.

The grid runs through harness.py (one folder per run in ``--runs-dir``, finished runs skipped, ``--jobs``);
writes ``OUT/dafkd_fmnist.md`` (top-1 % as mean ± std over seeds beside the paper's Table 1 / 3, rounds to
60% and 65% beside Table 2 / 3b, seconds per round, which of Table 1's orderings hold (each method minus FedAvg,
paired by seed), each baseline's mechanism diagnostics, DaFKD's diagnostics, and whether its mechanism works:
each discriminator's domain AUC, Eq. 7's entropy on real images, the Eq. 7 / uniform / oracle ensembles; plotted
over rounds in ``OUT/dafkd_fmnist_mechanism.png``) and ``OUT/dafkd_fmnist.json`` (the record and every run's
figures).

Differences paired by seed (each method minus FedAvg, DaFKD minus its ablations, FedGen with minus without a client
term, DaFKD minus FedAvg) need both runs from one machine: each run folder names the machine that finished it
(``machine.json``, written by the harness; backfilled for the 2026-11-28 runs from this record, whose invocations
name the AMD EPYC; the 2026-11-26 runs' record says only "CPU, 2 cores", so they name none), and a seed across
machines, or with a run that names none, is left out and said (``harness.paired_by_seed``, the decomposition's rule).
A difference within one run (the distillation or fine-tuning against the average it starts from) pairs always.

    .venv/bin/python benchmarks/papers/dafkd_fmnist.py --jobs 2                    # the recorded grid
    .venv/bin/python benchmarks/papers/dafkd_fmnist.py --report-only               # tables from the runs
    .venv/bin/python benchmarks/papers/dafkd_fmnist.py --rounds 3 --seeds 0 --settings alpha0.1 \
        --out /tmp/smoke --runs-dir /tmp/smoke/runs                                  # smoke

Cost on the 2-core development machine (shared), seconds per round including evaluation: FedAvg ~3.6,
FedProx ~4.1, FedGen ~2, FedDF ~7 (500 x 10 proxy images), FedFTG ~8, DaFKD ~9.2 (with the extra evaluation of
the average), no-sharing ~11.6, no-correlation ~10.9; the recorded grid (48 runs of 60 rounds) takes about 5 h in
one process.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

import harness
from harness import Finished, Run, fmt_mean_std

NAME = "dafkd_fmnist"
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"name": "fedavg"},
    "fedprox": {"name": "fedprox", "mu": 0.01},
    # FedDFusion: FedDF on unlabelled training samples as the proxy data (DaFKD Sec. 4.1), 500 a class, copied so
    # that the clients' data is FedAvg's
    "feddf": {"name": "feddf"},
    "fedgen": {"preset": "fedgen_fmnist"},  # the preset's algorithm section
    # which of FedGen's two client terms carries it: without the CE on generated features, without the latent KL
    "fedgen_no_feature_ce": {"preset": "fedgen_fmnist", "alpha": 0.0},
    "fedgen_no_latent_kl": {"preset": "fedgen_fmnist", "beta": 0.0},
    "fedftg": {"preset": "fedftg_fmnist", "eval_average": True},
    "dafkd": {},  # the preset's algorithm section
    "dafkd_no_sharing": {"sharing": False},
    "dafkd_no_correlation": {"correlation": False},
}
FEDDF_PROXY = {"data.server_data.kind": "holdout", "data.server_data.per_class": 500,
               "data.server_data.labelled": False, "data.server_data.keep_in_training": True}
# DaFKD paper, Fashion-MNIST, E=20: Table 1 / Table 3(a) top-1 % and Table 2 / Table 3(b) rounds to 60% / 65%.
PAPER_ACC = {
    ("fedavg", 0.05): "30.01 ± 0.54", ("fedavg", 0.1): "67.97 ± 0.03", ("fedavg", 10.0): "82.37 ± 0.82",
    ("fedprox", 0.05): "39.71 ± 0.23", ("fedprox", 0.1): "66.65 ± 0.08", ("fedprox", 10.0): "82.06 ± 0.53",
    ("feddf", 0.05): "30.08 ± 0.82", ("feddf", 0.1): "68.46 ± 0.14", ("feddf", 10.0): "82.67 ± 1.03",
    ("fedgen", 0.05): "36.59 ± 0.98", ("fedgen", 0.1): "67.29 ± 2.05", ("fedgen", 10.0): "81.57 ± 1.96",
    ("fedftg", 0.05): "34.84 ± 0.77", ("fedftg", 0.1): "67.25 ± 0.14", ("fedftg", 10.0): "81.96 ± 1.86",
    ("dafkd", 0.05): "37.85 ± 0.24", ("dafkd", 0.1): "70.81 ± 0.21", ("dafkd", 10.0): "83.37 ± 0.06",
    ("dafkd_no_sharing", 0.05): "35.45 ± 0.34", ("dafkd_no_sharing", 0.1): "70.51 ± 0.14",
    ("dafkd_no_correlation", 0.05): "34.64 ± 1.68", ("dafkd_no_correlation", 0.1): "64.35 ± 1.87",
}
PAPER_ROUNDS = {  # alpha = 0.1
    "fedavg": ("21.00 ± 1.33", "35.67 ± 3.67"), "fedprox": ("22.67 ± 5.67", "38.33 ± 4.00"),
    "feddf": ("20.67 ± 3.33", "34.33 ± 0.67"), "fedgen": ("25.00 ± 3.33", "39.67 ± 2.67"),
    "fedftg": ("27.67 ± 4.67", "43.33 ± 6.66"),
    "dafkd": ("18.67 ± 2.33", "33.67 ± 3.00"), "dafkd_no_sharing": ("18.67 ± 1.00", "33.33 ± 1.67"),
    "dafkd_no_correlation": ("19.33 ± 0.67", "37.67 ± 1.67"),
}
TARGETS = (0.60, 0.65)
SETTINGS = {"alpha0.1": 0.1, "alpha1": 1.0}  # Dirichlet alpha
DIAGNOSTICS = ("eval/accuracy", "eval/accuracy_avg", "server/alpha_max_mean", "server/alpha_entropy",
               "server/disc_score_mean", "train/disc_acc_real", "train/disc_acc_fake", "server/kd_loss_first",
               "server/kd_loss", "train/loss", "train/gen_loss")
# Does the mechanism work (simulation-only, real images; README's DaFKD section)?
MECHANISM = ("diag/domain_auc", "diag/alpha_entropy_real", "diag/ens_acc_eq7", "diag/ens_acc_uniform",
             "diag/ens_acc_label_share", "diag/ens_acc_theorem1")
FORMER_KEYS = {"diag/ens_acc_label_share": "diag/ens_acc_oracle"}  # the key's name in runs written before

# The baselines' mechanisms, read over the last 5 rounds (key, what it says); docs/metrics.md has every key.
BASELINE_DIAGNOSTICS: dict[str, list[tuple[str, str]]] = {
    "feddf": [("diag/teacher_acc", "ensemble acc. on the proxy data"),
              ("diag/student_acc_start", "average's acc. there"), ("diag/student_acc", "distilled student's acc."),
              ("server/val_agreement", "student-ensemble agreement")],
    "fedgen": [("server/gen_acc_global", "global model reads G(y) as y"),
               ("server/gen_acc_teachers", "clients' ensemble reads G(y) as y"),
               ("server/gen_diversity", "diversity term"), ("train/gen_ce", "clients' CE on G(y)"),
               ("train/gen_kl", "clients' latent KL")],
    "fedftg": [("eval/accuracy_avg", "test acc. of the average before fine-tuning"),
               ("eval/accuracy", "test acc. after"), ("server/gen_acc_teachers", "clients' ensemble reads G(y) as y"),
               ("server/gen_acc_global", "fine-tuned model reads G(y) as y"), ("server/ft_kd", "student's loss")],
}
# DaFKD Table 1, Fashion-MNIST, alpha = 0.1: the paper's ordering of the six methods.
TABLE1_METHODS = ("fedavg", "fedprox", "feddf", "fedgen", "fedftg", "dafkd")
# DaFKD Table 3: the ablations DaFKD is read against
ABLATIONS = ("dafkd_no_sharing", "dafkd_no_correlation")


def make_config(method: str, alpha: float, seed: int, rounds: int, data_dir: str | None, eval_average: bool,
                preset: str = "dafkd_fmnist", budget: dict | None = None, device: str = "cpu"):
    from fedray.load import load_config, validate_config
    from fedray.overrides import apply_overrides

    raw = load_config(preset).model_dump(mode="json")
    spec = dict(METHODS[method])
    if method.startswith("dafkd"):
        raw["algorithm"].update(spec, eval_average=eval_average)
    elif "preset" in spec:  # the method's own preset gives its algorithm section; the budget stays DaFKD's
        raw["algorithm"] = {**load_config(spec.pop("preset")).model_dump(mode="json")["algorithm"], **spec}
    else:
        raw["algorithm"] = spec
    over = {"name": f"bench_{method}", "seed": seed, "data.alpha": alpha, "federation.rounds": rounds,
            "tracking.enabled": False, "runtime.backend": "local", "runtime.num_cpus_per_worker": 1,
            "runtime.device": device, **(FEDDF_PROXY if method == "feddf" else {}), **(budget or {})}
    if data_dir:
        over["data.data_dir"] = data_dir
    return validate_config(apply_overrides(raw, over))


def build(run: Run, opts: dict):
    return make_config(run.method, SETTINGS[run.setting], run.seed, opts["rounds"], opts["data_dir"],
                       opts["eval_average"], opts["preset"], opts["budget"], opts["device"])


# --- collection -----------------------------------------------------------------------------------------------


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def collect(grid: dict[tuple[str, str], list[Finished]]) -> list[dict]:
    from fedray.evaluation import rounds_to_target

    runs = []
    for (m, setting), recs in grid.items():
        for f in recs:
            summary, hist = f.summary, f.history
            rec = {"method": m, "alpha": SETTINGS[setting], "seed": f.seed, "dir": harness.shown(f.run.out),
                   "cpu": harness.run_machine(f.run.out),  # None: the folder names no machine (pairs refused)
                   "accuracy": summary["eval/accuracy"], "best_accuracy": summary["eval/best_accuracy"],
                   "accuracy_last5": harness.last_n(hist, "eval/accuracy"),
                   "rounds": summary["rounds"], "time_round_s": summary["time/round_s"],
                   "comm_bytes_up": summary["comm/bytes_up"], "comm_bytes_down": summary["comm/bytes_down"],
                   "rounds_to": {f"{t:.2f}": rounds_to_target([row["round"] for row in hist],
                                                              [_num(row.get("eval/accuracy")) for row in hist], t)
                                 for t in TARGETS}}
            if m.startswith("dafkd") or m == "fedftg":
                rec["accuracy_avg"] = _num(summary.get("eval/accuracy_avg"))
                rec["accuracy_avg_last5"] = harness.last_n(hist, "eval/accuracy_avg")
            if m.startswith("dafkd"):
                rec["per_round"] = {k: [_num(row.get(k, row.get(FORMER_KEYS.get(k, k)))) for row in hist]
                                    for k in (*DIAGNOSTICS, *MECHANISM)}
            family = m.split("_")[0]  # fedgen_no_latent_kl: fedgen's diagnostics
            if family in BASELINE_DIAGNOSTICS:
                rec["diagnostics_last5"] = {k: harness.last_n(hist, k) for k, _ in BASELINE_DIAGNOSTICS[family]}
            runs.append(rec)
    return runs


def _by_seed(recs: list[dict], key: str) -> dict[int, float]:
    """seed -> the run's ``key`` in points."""
    return {r["seed"]: 100 * r[key] for r in recs if r.get(key) is not None}


def _vs(by: dict, m: str, base: str, a: float, key: str = "accuracy_last5") -> harness.Paired | str | None:
    """``m`` minus ``base`` at alpha ``a`` in points of ``key``, paired by seed over the seeds whose two runs one
    machine made (:func:`harness.paired_by_seed`)."""
    ra, rb = by.get((m, a), []), by.get((base, a), [])
    return harness.paired_by_seed(_by_seed(ra, key), _by_seed(rb, key),
                                  ({r["seed"]: r.get("cpu") for r in ra}, {r["seed"]: r.get("cpu") for r in rb}))


def _reading(p: harness.Paired | str, paper: float | None) -> str:
    """holds / reversed / within noise against the paper's sign (above / below without one); no reading under 3
    seeds or without a difference."""
    if not isinstance(p, tuple):
        return "no reading"
    diff, se, n, _ = p
    if n < 3:
        return f"{n} seed{'s' if n > 1 else ''}: no reading"
    if abs(diff) <= 2 * se:
        return "within noise"
    if paper is None:
        return "above" if diff > 0 else "below"
    return "holds" if (diff > 0) == (paper > 0) else "reversed"


SAME_MACHINE = ("only between runs that one machine made (each run folder's `machine.json`; a seed of another or an "
                f"unnamed machine is left out, and \"{harness.OTHER_CPU}\" or \"{harness.NO_CPU}\" stands where every "
                "seed is: a CPU's kernels round differently, which a difference across machines mixes in)")


def machines(runs: list[dict]) -> list[str]:
    """Which machine made the runs (each folder's ``machine.json``), and the runs that name none, by method."""
    counts: dict[str, int] = {}
    unnamed: dict[str, dict[float, list[int]]] = {}
    for r in runs:
        counts[r.get("cpu") or "not recorded"] = counts.get(r.get("cpu") or "not recorded", 0) + 1
        if r.get("cpu") is None:
            unnamed.setdefault(r["method"], {}).setdefault(r["alpha"], []).append(r["seed"])
    lines = ["Machines (each run folder's `machine.json`): " + ", ".join(f"{c} {n} runs" for c, n in counts.items())
             + "."]
    if unnamed:
        by_cells: dict[str, list[str]] = {}
        for m, cells in unnamed.items():
            where = "; ".join(f"α={a:g} (seed{'s' if len(s) > 1 else ''} {', '.join(map(str, sorted(s)))})"
                              for a, s in cells.items())
            by_cells.setdefault(where, []).append(m)
        lines += ["Runs that name no machine (their pairs with any run are refused):",
                  *[f"- {', '.join(ms)}: {where}" for where, ms in by_cells.items()]]
    return lines + [""]


def _ms(values: list[float], scale: float = 100.0) -> str:
    """fedray.report's mean ± std, with the number of seeds when it is not 2."""
    if not values:
        return "—"
    return fmt_mean_std(values, scale) + (f" (n={len(values)})" if len(values) != 2 else "")


def _rounds_cell(hits: list[int | None], rounds: int) -> str:
    got = [h for h in hits if h is not None]
    if not hits:
        return "—"
    if not got:
        return f"> {rounds}"
    text = fmt_mean_std(got, 1.0)
    return text if len(got) == len(hits) else f"{text} ({len(got)}/{len(hits)} reached)"


def _mean_curve(recs: list[dict], key: str) -> list[float | None]:
    curves = [r["per_round"][key] for r in recs if key in r.get("per_round", {})]
    if not curves:
        return []
    out = []
    for i in range(max(len(c) for c in curves)):
        vals = [c[i] for c in curves if i < len(c) and c[i] is not None]
        out.append(float(np.mean(vals)) if vals else None)
    return out


def _window(curve: list[float | None], first: bool, n: int = 5) -> float | None:
    vals = [v for v in (curve[:n] if first else curve[-n:]) if v is not None]
    return float(np.mean(vals)) if vals else None


def mechanism(by: dict, alphas) -> list[str]:
    """Does Eq. 7 do what the paper says, here? From the diag/* curves of the DaFKD runs (mean over seeds)."""
    lines = ["", "## Does the mechanism work? (DaFKD runs; simulation-only diagnostics on real images)", "",
             "| α | domain AUC first 5 → last 5 | Eq. 7 entropy on real images first 5 → last 5 | ensemble accuracy "
             "(%), last 5: Eq. 7 / uniform / label share / Theorem 1 |", "|---|---|---|---|"]
    for a in alphas:
        recs = by.get(("dafkd", a), [])
        if not recs or not any("diag/domain_auc" in r.get("per_round", {}) for r in recs):
            continue
        c = {k: _mean_curve(recs, k) for k in MECHANISM}
        fmt = lambda v, pct=False: "—" if v is None else (f"{100 * v:.2f}" if pct else f"{v:.3f}")  # noqa: E731
        lines.append(f"| {a:g} | {fmt(_window(c['diag/domain_auc'], True))} → {fmt(_window(c['diag/domain_auc'], False))}"
                     f" | {fmt(_window(c['diag/alpha_entropy_real'], True))} → "
                     f"{fmt(_window(c['diag/alpha_entropy_real'], False))} | "
                     + " / ".join(fmt(_window(c[k], False), True) for k in MECHANISM[2:]) + " |")
    lines += ["", "AUC 0.5: a client's discriminator cannot tell its own images from the others'. Entropy 1: "
              "uniform weights. Label share: each client weighted by its share of the training images of the "
              "image's true class. Theorem 1: Eq. 7 with the optimal discriminators of Theorem 1 under the run's "
              "label distributions, the ceiling of the discriminators' weights (— in runs recorded before it)."]
    return lines


def _paper_value(m: str, a: float) -> float | None:
    text = PAPER_ACC.get((m, a))
    return float(text.split("±")[0]) if text else None


def orderings(by: dict, alphas) -> list[str]:
    """Table 1's comparisons read as a researcher would: each method against FedAvg, ours (mean of the last 5 rounds
    over seeds, with the standard error of the difference) beside the paper's sign, and the ranking; then Table 3's:
    DaFKD against each of its ablations."""
    lines = ["", "## Table 1's orderings: which hold here", "",
             "Each method minus FedAvg, in points of the mean of the last 5 rounds, paired by seed (a seed fixes the "
             "partition and the initial model) and averaged over the seeds both have, " + SAME_MACHINE + "; ±: the "
             "standard error of that mean difference; n = 3 seeds unless said. Reading: *holds* when our difference "
             "has the paper's sign and exceeds twice its standard error, *reversed* when it has the other sign and "
             "does, *within noise* otherwise; no reading under 3 seeds.", "",
             "| α | method | ours − FedAvg | paper − FedAvg | reading |", "|---|---|---|---|---|"]
    for a in alphas:
        for m in TABLE1_METHODS[1:]:
            p = _vs(by, m, "fedavg", a)
            if p is None:
                continue
            pm, pf = _paper_value(m, a), _paper_value("fedavg", a)
            paper = None if pm is None or pf is None else pm - pf
            lines.append(f"| {a:g} | {m} | {harness.fmt_paired(p)} | "
                         f"{'—' if paper is None else f'{paper:+.2f}'} | {_reading(p, paper)} |")
    for a in alphas:
        ranked = sorted(((float(np.mean([r["accuracy_last5"] for r in by[(m, a)]])), m) for m in TABLE1_METHODS
                         if by.get((m, a))), reverse=True)
        if ranked:
            text = f"Ranking at α={a:g} (last 5): " + " > ".join(f"{m} {100 * v:.2f}" for v, m in ranked)
            paper = sorted(((_paper_value(m, a), m) for m in TABLE1_METHODS if _paper_value(m, a) is not None),
                           reverse=True)
            if paper:
                text += "; the paper's: " + " > ".join(f"{m} {v:.2f}" for v, m in paper)
            lines += ["", text + "."]
    rows = []
    for a in alphas:
        for m in ABLATIONS:
            p = _vs(by, "dafkd", m, a)
            if p is None:
                continue
            pd, pm = _paper_value("dafkd", a), _paper_value(m, a)
            paper = None if pd is None or pm is None else pd - pm
            rows.append(f"| {a:g} | {m} | {harness.fmt_paired(p)} | {'—' if paper is None else f'{paper:+.2f}'} | "
                        f"{_reading(p, paper)} |")
    if rows:
        lines += ["", "## Table 3's ablations: DaFKD minus each", "",
                  "DaFKD minus the ablation, in points of the mean of the last 5 rounds, paired by seed on one machine "
                  "as Table 1's orderings above; the paper's difference from its Table 3, read as Table 1's.", "",
                  "| α | ablation | DaFKD − ablation | paper DaFKD − ablation | reading |", "|---|---|---|---|---|",
                  *rows]
    return lines


def baseline_mechanisms(by: dict, alphas) -> list[str]:
    """What each baseline's own mechanism does here: its diagnostics over the last 5 rounds, mean over seeds."""
    lines = ["", "## What the baselines' mechanisms do (last 5 rounds, mean over seeds)", ""]
    for m, keys in [(m, BASELINE_DIAGNOSTICS[m.split("_")[0]]) for m in METHODS
                    if m.split("_")[0] in BASELINE_DIAGNOSTICS]:
        rows = []
        for a in alphas:
            recs = [r for r in by.get((m, a), []) if r.get("diagnostics_last5")]
            if recs:
                vals = [[r["diagnostics_last5"][k] for r in recs if r["diagnostics_last5"][k] is not None]
                        for k, _ in keys]
                rows.append(f"| {a:g} | " + " | ".join(
                    "—" if not v else (f"{100 * np.mean(v):.2f}" if ("acc" in k or k.startswith("eval/")) else
                                       f"{np.mean(v):.4f}") for (k, _), v in zip(keys, vals)) + " |")
        if rows:
            lines += [f"**{m}** (accuracies in %)", "", "| α | " + " | ".join(d for _, d in keys) + " |",
                      "|---|" + "---|" * len(keys), *rows, ""]
    def paired(what: str, a: dict[int, float], b: dict[int, float], cpus) -> None:
        """a - b by seed: across runs (``cpus``, each side's seed -> machine) only the seeds one machine made."""
        seeds = set(a) & set(b)
        kept, refused = harness.same_machine_seeds(seeds, cpus)
        if refused:
            lines.append(f"- {what}, last 5 rounds: {refused}.")
            return
        gains = [a[s] - b[s] for s in kept]
        left = len(seeds) - len(kept)
        if len(gains) >= 2:
            lines.append(f"- {what}, last 5 rounds: {np.mean(gains):+.2f} ± "
                         f"{np.std(gains, ddof=1) / np.sqrt(len(gains)):.2f} points (mean ± standard error over "
                         f"{len(gains)} seeds; per seed " + ", ".join(f"{g:+.2f}" for g in gains)
                         + (f"; {left} seed{'s' if left > 1 else ''} of another CPU left out" if left else "") + ").")

    for a in alphas:
        # what FedFTG's fine-tuning adds to the average it starts from, within each run
        ftg = by.get(("fedftg", a), [])  # within each run: no machine to match
        paired(f"fedftg, α={a:g}: fine-tuning minus the average it starts from",
               _by_seed([r for r in ftg if r.get("accuracy_avg_last5") is not None], "accuracy_last5"),
               _by_seed(ftg, "accuracy_avg_last5"), None)
        # what each of FedGen's client terms adds, paired by seed with the run without it (one machine)
        full = by.get(("fedgen", a), [])
        for ablation, term in (("fedgen_no_feature_ce", "the CE on generated features"),
                               ("fedgen_no_latent_kl", "the latent KL")):
            without = by.get((ablation, a), [])
            paired(f"fedgen, α={a:g}: with minus without {term}", _by_seed(full, "accuracy_last5"),
                   _by_seed(without, "accuracy_last5"),
                   ({r["seed"]: r.get("cpu") for r in full}, {r["seed"]: r.get("cpu") for r in without}))
    return lines


def plot_mechanism(by: dict, alphas, path: Path) -> Path | None:
    """The diag/* curves over rounds, one panel per α (mean over seeds)."""
    panels = [a for a in alphas if any("diag/domain_auc" in r.get("per_round", {}) for r in by.get(("dafkd", a), []))]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.6), squeeze=False)
    for ax, a in zip(axes[0], panels):
        recs = by[("dafkd", a)]
        for key, label in (("diag/domain_auc", "domain AUC"), ("diag/alpha_entropy_real", "Eq. 7 entropy (real)"),
                           ("diag/ens_acc_eq7", "ens. acc Eq. 7"), ("diag/ens_acc_uniform", "ens. acc uniform"),
                           ("diag/ens_acc_label_share", "ens. acc label share"),
                           ("diag/ens_acc_theorem1", "ens. acc Theorem 1"), ("eval/accuracy", "DaFKD acc"),
                           ("eval/accuracy_avg", "average before distillation")):
            curve = _mean_curve(recs, key)
            if curve:
                ax.plot(range(1, len(curve) + 1), [np.nan if v is None else v for v in curve], label=label)
        ax.axhline(0.5, color="grey", lw=0.5, ls=":")
        ax.set_title(f"DaFKD, α={a:g}, {len(recs)} seed(s)")
        ax.set_xlabel("round")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(runs: list[dict], methods, alphas, rounds: int, meta: dict, setting: str, runs_dir: Path,
             planned: list[Run]) -> str:
    by = {}
    for r in runs:
        by.setdefault((r["method"], r["alpha"]), []).append(r)
    seeds = sorted({r["seed"] for r in runs})
    lines = harness.header("DaFKD on Fashion-MNIST", meta, NAME, runs_dir, planned) + machines(runs) + [
             f"{setting}, {rounds} rounds, seeds {', '.join(map(str, seeds))}; the same budget for every method. "
             "Paper: ResNet-11 and its own FedAvg/FedProx runs, E=20 epochs, T=60 (Table 1, 2, 3); its numbers are "
             "copied for reference, not reproduced settings.", "",
             "## Top-1 test accuracy (%), last round, mean ± std over seeds", ""]
    head = ["method"]
    for a in alphas:
        head += [f"α={a:g}", f"last 5, α={a:g}", f"paper α={a:g}"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        row = [m]
        for a in alphas:
            recs = by.get((m, a), [])
            row += [_ms([r["accuracy"] for r in recs]), _ms([r["accuracy_last5"] for r in recs]),
                    PAPER_ACC.get((m, a), "—")]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "last 5: the mean of the last 5 rounds' accuracy (one round's figure swings by 10-20 points "
              "at α=0.1)."]
    if any((m, a) not in PAPER_ACC for m in methods for a in alphas):
        near = ", ".join(f"{m} {PAPER_ACC[(m, 10.0)]}" for m in methods if (m, 10.0) in PAPER_ACC)
        lines += ["", "—: the paper has no such run; on Fashion-MNIST it reports α ∈ {0.05, 0.1, 10} "
                  f"(α=10: {near}) and the ablations at α ∈ {{0.05, 0.1}}."]
    for a in alphas:
        lines += ["", f"## Rounds to reach 60% / 65% (α={a:g}; mean ± std over the seeds that reached it)", "",
                  "| method | 60% | 65% | paper 60% | paper 65% | best acc. (%) | s/round | MB up/round "
                  "| MB down/round |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for m in methods:
            recs = by.get((m, a), [])
            if not recs:
                continue
            paper = PAPER_ROUNDS.get(m, ("—", "—")) if a == 0.1 else ("—", "—")
            secs = np.mean([r["time_round_s"] for r in recs])
            up = np.mean([r["comm_bytes_up"] / r["rounds"] for r in recs]) / 1e6
            down = np.mean([r["comm_bytes_down"] / r["rounds"] for r in recs]) / 1e6
            lines.append(f"| {m} | {_rounds_cell([r['rounds_to']['0.60'] for r in recs], rounds)} | "
                         f"{_rounds_cell([r['rounds_to']['0.65'] for r in recs], rounds)} | {paper[0]} | {paper[1]} | "
                         f"{_ms([r['best_accuracy'] for r in recs])} | {secs:.2f} | {up:.2f} | {down:.2f} |")
    # verdict and diagnostics
    lines += ["", "## DaFKD against FedAvg, and what the distillation adds", ""]
    lines += ["DaFKD minus FedAvg in points, paired by seed (± standard error; n = 3 seeds unless said), "
              + SAME_MACHINE + "; the distillation against the plain average before it within each DaFKD run (mean "
              "over seeds).", ""]
    for a in alphas:
        fa, dk = by.get(("fedavg", a), []), by.get(("dafkd", a), [])
        if fa and dk:
            for key, avg_key, when in (("accuracy", "accuracy_avg", "last round"),
                                       ("accuracy_last5", "accuracy_avg_last5", "last 5 rounds")):
                p = _vs(by, "dafkd", "fedavg", a, key)
                avg = [r[avg_key] for r in dk if r.get(avg_key) is not None]
                gain = 100 * (np.mean([r[key] for r in dk]) - np.mean(avg)) if avg else None
                verdict = ("" if not isinstance(p, tuple) else
                           "beats FedAvg: " if p[0] > 0 else "does NOT beat FedAvg: ")
                lines.append(("- " if key == "accuracy" else "  ") + f"α={a:g}, {when}: DaFKD minus FedAvg "
                             f"{harness.fmt_paired(p)}" + (f" (DaFKD {verdict.rstrip(': ')})" if verdict else "")
                             + (f"; distillation vs. the plain average before it: {gain:+.2f} points"
                                if gain is not None else "") + ".")
    lines += ["", "Diagnostics (mean over seeds; `acc_avg` = the plain Eq. 6 average before distillation; "
              "`alpha_max` = mean over samples of max_k alpha (1/8 uniform .. 1 one client); `alpha_H` = mean "
              "normalised entropy of alpha (1 uniform .. 0 one client); `D(x̂)` = mean discriminator score on the "
              "distillation set; `D acc real/fake` = clients' discriminator accuracy on real / generated batches "
              "during local training; `KL start/mean` = distillation loss at the first step / over all steps):", ""]
    short = {"eval/accuracy": "acc", "eval/accuracy_avg": "acc_avg", "server/alpha_max_mean": "alpha_max",
             "server/alpha_entropy": "alpha_H", "server/disc_score_mean": "D(x̂)", "train/disc_acc_real": "D acc real",
             "train/disc_acc_fake": "D acc fake", "server/kd_loss_first": "KL start", "server/kd_loss": "KL mean",
             "train/loss": "CE", "train/gen_loss": "G loss"}
    for m in [m for m in methods if m.startswith("dafkd")]:
        for a in alphas:
            recs = by.get((m, a), [])
            if not recs:
                continue
            curves = {k: _mean_curve(recs, k) for k in DIAGNOSTICS}
            n = max((len(c) for c in curves.values()), default=0)
            shown = sorted({*range(0, n, max(1, n // 10)), n - 1}) if n else []
            lines += ["", f"### {m}, α={a:g}", "", "| round | " + " | ".join(short[k] for k in DIAGNOSTICS) + " |",
                      "|---|" + "---|" * len(DIAGNOSTICS)]
            for i in shown:
                cells = []
                for k in DIAGNOSTICS:
                    v = curves[k][i] if i < len(curves[k]) else None
                    cells.append("—" if v is None else (f"{100 * v:.2f}" if k.startswith("eval/") else f"{v:.4f}"))
                lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines += orderings(by, alphas)
    lines += baseline_mechanisms(by, alphas)
    lines += mechanism(by, alphas)
    return "\n".join(lines) + "\n"


def setting_of(grid: dict[tuple[str, str], list[Finished]]) -> tuple[str, int]:
    """The budget every method shared, from a run's config, and the rounds."""
    p = next(r for recs in grid.values() for r in recs).params
    local = (f"{p['federation.local_epochs']} local epochs" if p.get("federation.local_epochs")
             else f"{p['federation.local_steps']} local steps")
    return (f"{p['model.name']}, K={p['data.num_clients']} clients, {p['federation.clients_per_round']} per round, "
            f"{local} of batch {p['federation.batch_size']}, {p['federation.optimizer']} lr {p['federation.lr']:g}, "
            f"weight decay {p['federation.weight_decay']:g}"), p["federation.rounds"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.grid_args(ap, NAME, list(METHODS), list(SETTINGS), rounds=60)
    ap.add_argument("--preset", default="dafkd_fmnist", choices=["dafkd_fmnist", "dafkd_resnet11", "dafkd_fmnist_authors"],
                    help="the DaFKD preset whose federation budget every method shares")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--local-epochs", type=int, help="every method's local budget in epochs (the paper: 20)")
    budget.add_argument("--local-steps", type=int, help="every method's local budget in steps")
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST root (default: fedray's usual lookup)")
    ap.add_argument("--no-eval-average", action="store_true", help="skip evaluating DaFKD's pre-distillation average")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    budget: dict[str, Any] = {}
    if args.local_epochs:
        budget = {"federation.local_epochs": args.local_epochs}
    elif args.local_steps:
        budget = {"federation.local_epochs": None, "federation.local_steps": args.local_steps}
    recorded = args.preset == "dafkd_fmnist" and not budget and args.rounds == 60
    if not recorded and not args.report_only and args.runs_dir == harness.RESULTS / f"{NAME}_runs":
        ap.error("another preset, budget or rounds than the recorded grid's: give its own --runs-dir (and --out)")
    opts = {"rounds": args.rounds, "data_dir": args.data_dir, "eval_average": not args.no_eval_average,
            "preset": args.preset, "budget": budget, "device": args.device, "threads": args.threads,
            "keep_models": args.keep_models}
    meta, table_runs = harness.run_grid(NAME, argv, ap, args, build, opts)
    grid = harness.collect(table_runs)
    if not grid:
        raise SystemExit(f"no finished run in {args.runs_dir}")
    runs = collect(grid)
    alphas = list(SETTINGS.values())
    setting, rounds = setting_of(grid)
    md = markdown(runs, list(METHODS), alphas, rounds, meta, setting, args.runs_dir, table_runs)
    by: dict = {}
    for r in runs:
        by.setdefault((r["method"], r["alpha"]), []).append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_mechanism(by, alphas, out / f"{NAME}_mechanism.png")
    if plot is not None:
        md += f"\n![the diagnostics over rounds]({plot.name})\n"
    record = {"settings": {"methods": METHODS, "alphas": alphas},
              "runs": [{k: v for k, v in r.items() if k != "per_round"} for r in runs],
              "paper": {"accuracy": {f"{m}@{a:g}": v for (m, a), v in PAPER_ACC.items()},
                        "rounds_to_60_65_alpha0.1": PAPER_ROUNDS}}
    harness.write(out, NAME, meta, record, md)
    print(md)


if __name__ == "__main__":
    main()
