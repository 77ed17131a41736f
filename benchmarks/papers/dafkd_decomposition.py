"""DaFKD taken apart on real Fashion-MNIST (alpha = 0.1): which part loses the points against FedAvg, Eq. 7's
weights, the generated distillation data, or distillation itself?

A grid of DaFKD cells (Eq. 7's weights, ``algorithm.alpha_source``, x the distillation data,
``algorithm.distill_data``, and the diagnostic cells below) beside FedAvg, on
``dafkd_fmnist``'s reduced budget (LeNet-5, K=20, 8 a round, 20 local Adam steps of batch 32, 60 rounds) with
the paper's conditional generator (the oracle needs each generated sample's class):

- ``disc_generated``: the method (Eq. 7 from the discriminators, on generated samples);
- ``oracle_generated`` / ``uniform_generated``: the label-share oracle (``alpha_source=label_share``: each client's
  share of the sample's class, not Theorem 1's optimum) / uniform weights, generated;
- ``disc_proxy`` / ``oracle_proxy`` / ``uniform_proxy``: the same weights, distilled on real unlabelled images
  (500 a class held by the server, copied so that the clients' data is FedAvg's; labelled only for the
  oracle, which reads the labels; the distillation never does);
- ``authors_head``: the authors' code where it differs cheaply (one discriminator head for all clients, here
  averaged by the server, adversarial training only in rounds 1-3 / 1-5), seed 0 beside the method;
- ``theorem1_generated`` / ``theorem1_proxy``: Eq. 7 at Theorem 1's optimal discriminators under the run's label
  distributions (``alpha_source=theorem1``), the ceiling of the discriminators' weights;
- ``ceiling_proxy``: Eq. 7 as if the generator had reached p (Theorem 1's premise): the discriminators trained
  against real images of every client's data instead of the generator's samples (``disc_negatives=pooled``; breaks
  privacy: a diagnostic, not a method) and the distillation on real images, the samples p would give;
- ``ceiling_generated``: the same discriminators on the generator's samples; the generator then trains against
  discriminators that never see its samples, so this cell changes the samples too, not only the weights;
- ``ceiling_proxy_detached`` / ``disc_proxy_detached`` / ``uniform_ceiling_proxy_detached``: ``ceiling_proxy``,
  ``disc_proxy`` and ``ceiling_proxy`` with uniform weights, each with the negatives detached from the shared
  extractor (``disc_negatives_grad=detached``): in ``ceiling_proxy`` the pooled images reach each client's feature
  extractor through Eq. 9, so its classifiers learn from other clients' images (a leak, not only other weights);
  detached, the head still learns from them and the classifiers from their own images only. Pooled against
  generated, both detached, changes the negatives only; against uniform weights, the weights only;
- ``classterm_generated``: the generator also trained to make the client's classifier read G(z, y) as y
  (``gen_class_weight=1``, an extension): do samples that show their class rescue the method?
- ``fedavg``: FedAvg with ``dafkd_fmnist.py``'s config, run by this script into its own folders (its 20-step runs
  were read from ``dafkd_fmnist.py``'s folders before, made on another machine).

Paired differences need both runs from one machine: each run folder names the machine that finished it
(``machine.json``, written by the harness; backfilled from this record for the runs made before), and a pair across
machines, or with a run that names none, is left out of the tables with the reason (a CPU's kernels round
differently, and over 60 rounds that moves accuracy as much as the contrasts do).

Every generated cell scores its samples with the fixed reader (``diag_reader``: ``diag/reader_*``).

Settings: ``steps20`` (3 seeds), ``steps200`` (10x the local steps, seed 0: every cell but ``authors_head``; seeds
0-2 for the detached cells and FedAvg) and
``epochs20`` (the paper's E = 20 local epochs, 12 rounds, seed 0: the method and FedAvg, diagnostics on: do the
domain AUC and the reader's agreement rise with the paper's local work?). Every DaFKD run also evaluates its plain
average before distillation (``eval/accuracy_avg``), which separates what the distillation does from what the
clients did.

Cost on a 2-core CPU, one thread a run: ~5 s a round for DaFKD at 20 steps (~5 min a run), ~28-50 s at 200 steps
(30-50 min a run), FedAvg ~4 s at 20 steps and ~8 s at 200; more seeds at 200 steps add as much each (GRID).

    .venv/bin/python benchmarks/papers/dafkd_decomposition.py --settings steps20 --jobs 2   # the 3-seed grid
    .venv/bin/python benchmarks/papers/dafkd_decomposition.py --settings steps20 steps200 --jobs 2 --methods fedavg \
        ceiling_proxy_detached disc_proxy_detached uniform_ceiling_proxy_detached      # the leak-free ceiling
    .venv/bin/python benchmarks/papers/dafkd_decomposition.py --settings steps200 --jobs 2  # 10x local steps
    .venv/bin/python benchmarks/papers/dafkd_decomposition.py --settings epochs20 --jobs 2  # E = 20, hours
    .venv/bin/python benchmarks/papers/dafkd_decomposition.py --report-only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import dafkd_fmnist
import harness
from harness import Run

NAME = "dafkd_decomposition"
PROXY = dict(dafkd_fmnist.FEDDF_PROXY)
CELLS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "disc_generated": {"alpha_source": "discriminator", "distill_data": "generated"},
    "oracle_generated": {"alpha_source": "label_share", "distill_data": "generated"},
    "uniform_generated": {"alpha_source": "uniform", "distill_data": "generated"},
    "disc_proxy": {"alpha_source": "discriminator", "distill_data": "proxy"},
    "oracle_proxy": {"alpha_source": "label_share", "distill_data": "proxy"},
    "uniform_proxy": {"alpha_source": "uniform", "distill_data": "proxy"},
    # the authors' code: one head for all clients (averaged here), adversarial training in the first rounds only
    "authors_head": {"disc_head": "averaged", "disc_train_rounds": 3, "gen_train_rounds": 5},
    # Eq. 7 at Theorem 1's optimal discriminators; the discriminators trained against real images of p (the ceiling,
    # which breaks privacy); the class term (an extension) that makes the samples show their class
    "theorem1_generated": {"alpha_source": "theorem1", "distill_data": "generated"},
    "theorem1_proxy": {"alpha_source": "theorem1", "distill_data": "proxy"},
    "ceiling_generated": {"alpha_source": "discriminator", "distill_data": "generated", "disc_negatives": "pooled"},
    "ceiling_proxy": {"alpha_source": "discriminator", "distill_data": "proxy", "disc_negatives": "pooled"},
    "classterm_generated": {"alpha_source": "discriminator", "distill_data": "generated", "gen_class_weight": 1.0},
    # the ceiling without the leak: the negatives (pooled or generated) train the heads, never the extractors; the
    # control for the negatives (generated, detached) and the one for the weights (uniform, pooled detached)
    "ceiling_proxy_detached": {"alpha_source": "discriminator", "distill_data": "proxy", "disc_negatives": "pooled",
                               "disc_negatives_grad": "detached"},
    "disc_proxy_detached": {"alpha_source": "discriminator", "distill_data": "proxy",
                            "disc_negatives_grad": "detached"},
    "uniform_ceiling_proxy_detached": {"alpha_source": "uniform", "distill_data": "proxy", "disc_negatives": "pooled",
                                       "disc_negatives_grad": "detached"},
}
DETACHED = ("ceiling_proxy_detached", "disc_proxy_detached", "uniform_ceiling_proxy_detached")
# each setting's local work (alpha 0.1 throughout): 20 steps (dafkd_fmnist's budget), 10x that, or the paper's E = 20
# local epochs (Sec. 4.1; ~1,250 steps of batch 32 a round for a client of 2,000 images), for which ROUNDS says how
# many rounds fit on a CPU (every round checkpointed: a stopped run goes on from its last round)
SETTINGS: dict[str, dict[str, Any]] = {
    "steps20": {},
    "steps200": {"federation.local_epochs": None, "federation.local_steps": 200},
    "epochs20": {"federation.local_epochs": 20},
}
ROUNDS = {"epochs20": 12}
# which cells each setting runs, with which seeds (the 10x budget: one seed of the cells that answer the question)
GRID = {"steps20": ({c: (0, 1, 2) for c in CELLS if c != "authors_head"} | {"authors_head": (0,)}),
        "steps200": {c: ((0, 1, 2) if c in DETACHED or c == "fedavg" else (0,)) for c in CELLS if c != "authors_head"},
        "epochs20": {"fedavg": (0,), "disc_generated": (0,)}}
# the contrasts: (cell, minus cell, what the difference isolates); each changes one part and keeps the rest
CONTRASTS = [
    ("oracle_generated", "disc_generated", "label-share weights instead of the discriminators'"),
    ("theorem1_generated", "disc_generated", "Theorem 1's optimal discriminators instead of the trained ones"),
    ("ceiling_generated", "disc_generated", "discriminators trained against real images of p (breaks privacy); the "
                                            "generator loses its adversary, so the samples change too"),
    ("ceiling_proxy", "disc_proxy", "discriminators trained against images of p, on real images: Eq. 7 if the "
                                    "generator had reached p"),
    ("ceiling_proxy", "theorem1_proxy", "the discriminators at p against Theorem 1's optimum, on real images"),
    ("ceiling_proxy", "ceiling_proxy_detached", "the leak: pooled images training each client's extractor too"),
    ("disc_proxy", "disc_proxy_detached", "the generated negatives training the extractors too"),
    ("ceiling_proxy_detached", "disc_proxy_detached", "negatives of p instead of generated ones, both detached: the "
                                                      "discriminators at p, the classifiers from their own images"),
    ("ceiling_proxy_detached", "uniform_ceiling_proxy_detached", "Eq. 7's weights from the discriminators at p "
                                                                 "(detached) instead of uniform ones"),
    ("ceiling_proxy_detached", "fedavg", "Eq. 7 from discriminators at p (detached), on real images, against FedAvg"),
    ("classterm_generated", "disc_generated", "samples that carry their class (the class term, an extension)"),
    ("uniform_generated", "disc_generated", "uniform weights instead of the discriminators'"),
    ("uniform_proxy", "disc_proxy", "uniform weights instead of the discriminators', on real images"),
    ("theorem1_proxy", "uniform_proxy", "Theorem 1's weights instead of uniform ones, on real images"),
    ("disc_proxy", "disc_generated", "real images instead of generated ones"),
    ("theorem1_proxy", "theorem1_generated", "real images instead of generated ones, Theorem 1's weights"),
    ("oracle_proxy", "oracle_generated", "real images instead of generated ones, label-share weights"),
    ("theorem1_proxy", "fedavg", "Eq. 7 at its optimum on real images against FedAvg"),
    ("oracle_proxy", "fedavg", "label-share weights on real images against FedAvg"),
    ("disc_generated", "fedavg", "the method against FedAvg"),
    ("authors_head", "disc_generated", "one head for all and early-only adversarial training (authors' code)")]
def planned(runs_dir: Path, cells, settings, seeds) -> list[Run]:
    """The grid's runs (of the asked cells, settings and seeds), FedAvg's among them, each in its folder."""
    return [Run(cell, setting, seed, runs_dir / harness.run_name(cell, setting, seed))
            for setting in settings for cell, cell_seeds in GRID[setting].items() for seed in cell_seeds
            if cell in cells and seed in seeds]


def make_config(cell: str, setting: str, seed: int, rounds: int, data_dir: str | None, device: str):
    from fedray.load import validate_config
    from fedray.overrides import apply_overrides

    budget = dict(SETTINGS[setting])
    rounds = ROUNDS.get(setting, rounds)
    if cell == "fedavg":
        return dafkd_fmnist.make_config("fedavg", 0.1, seed, rounds, data_dir, True, budget=budget, device=device)
    base = dafkd_fmnist.make_config("dafkd", 0.1, seed, rounds, data_dir, True, budget=budget, device=device)
    over: dict[str, Any] = {"name": f"bench_dafkd_{cell}", "algorithm.generator": "conditional",
                            **{f"algorithm.{k}": v for k, v in CELLS[cell].items()}}
    if CELLS[cell].get("distill_data") == "proxy":
        over.update(PROXY)
        # labelled only for the oracles, which read the labels
        over["data.server_data.labelled"] = CELLS[cell]["alpha_source"] in ("label_share", "theorem1")
    else:  # the fixed reader scores the generated samples (diag/reader_*)
        over["algorithm.diag_reader"] = True
    return validate_config(apply_overrides(base.model_dump(mode="json"), over))


def build(run: Run, opts: dict):
    return make_config(run.method, run.setting, run.seed, opts["rounds"], opts["data_dir"], opts["device"])


# --- the tables -------------------------------------------------------------------------------------------------


OTHER_CPU, NO_CPU = harness.OTHER_CPU, harness.NO_CPU  # a pair refused, and why
_fmt = harness.fmt_paired


def _paired(fa: dict, fb: dict, key_a: str = "acc", key_b: str = "acc") -> harness.Paired | str | None:
    """Two cells' figures paired by seed (:func:`harness.paired_by_seed`): only seeds whose two runs one machine made
    (their ``cpu``); a figure against another of the same runs (``fa is fb``) pairs every seed."""
    return harness.paired_by_seed(fa[key_a], fb[key_b], None if fa is fb else (fa["cpu"], fb["cpu"]))


# the mechanism figures beside the accuracy: key in the history -> column (mean of the last 5 evaluated rounds)
DIAG = {"diag/domain_auc": "domain AUC", "diag/reader_agreement": "reader agreement",
        "diag/reader_class_entropy": "reader class entropy", "diag/reader_fid": "reader FID",
        "diag/ens_acc_eq7": "Eq. 7 ensemble", "diag/ens_acc_theorem1": "Theorem 1 ensemble",
        "diag/ens_acc_label_share": "label-share ensemble", "train/disc_acc_real": "D real acc",
        "train/disc_acc_fake": "D fake acc"}
OLD_KEYS = {"diag/ens_acc_label_share": "diag/ens_acc_oracle"}  # the key in runs recorded before the rename
PERCENT = {"diag/reader_agreement", "diag/ens_acc_eq7", "diag/ens_acc_theorem1", "diag/ens_acc_label_share",
           "train/disc_acc_real", "train/disc_acc_fake"}


def figures(grid) -> dict[tuple[str, str], dict[str, dict[int, float]]]:
    """Per (cell, setting): seed -> last-5 test accuracy (%), of the average before distillation, Eq. 7's entropy,
    each mechanism figure of :data:`DIAG`, the mean seconds a round, and the machine that made the run (``cpu``)."""
    out = {}
    for (cell, setting), recs in grid.items():
        fig: dict[str, dict[int, Any]] = {"acc": {}, "avg": {}, "entropy": {}, "round_s": {}, "cpu": {}}
        for f in recs:
            fig["acc"][f.seed] = 100 * harness.last_n(f.history, "eval/accuracy")
            fig["cpu"][f.seed] = harness.run_machine(f.run.out)  # None: the folder names no machine
            for name, key, scale in (("avg", "eval/accuracy_avg", 100), ("entropy", "server/alpha_entropy", 1),
                                     *((k, k, 100 if k in PERCENT else 1) for k in DIAG)):
                value = harness.last_n(f.history, key)
                if value is None and key in OLD_KEYS:
                    value = harness.last_n(f.history, OLD_KEYS[key])
                if value is not None:
                    fig.setdefault(name, {})[f.seed] = scale * value
            times = [r["time/round_s"] for r in f.history if r.get("time/round_s") is not None]
            if times:
                fig["round_s"][f.seed] = float(np.median(times))  # a paused or crowded round does not count
        out[(cell, setting)] = fig
    return out


def _mean(values: dict[int, float], digits: int = 2) -> str:
    """mean ± sample standard deviation over the seeds, n when not 3 (one seed: its value and n=1)."""
    v = list(values.values())
    if len(v) == 1:
        return f"{v[0]:.{digits}f} (n=1)"
    return harness.fmt_mean_std(v, 1, digits) + (f" (n={len(v)})" if len(v) not in (0, 3) else "")


def by_round(grid, cell: str, setting: str, keys: Sequence[str]) -> list[dict[str, float]]:
    """One run's (seed 0's) figures round by round: the E = 20 trajectory."""
    recs = [f for f in grid.get((cell, setting), []) if f.seed == 0]
    return [{k: r[k] for k in ("round", "time/round_s", *keys) if r.get(k) is not None}
            for r in (recs[0].history if recs else [])]


def markdown(figs, grid, meta: dict, runs_dir: Path, planned_runs: list[Run], rounds: int) -> str:
    lines = harness.header("DaFKD decomposed: weights, generated data, or distillation itself (Fashion-MNIST, "
                           "alpha = 0.1)", meta, NAME, runs_dir, planned_runs)
    lines += ["LeNet-5, K=20, 8 clients a round, Adam lr 1e-3, batch 32, the conditional generator; `steps20`: 20 "
              f"local steps (dafkd_fmnist's budget), `steps200`: 10x, {rounds} rounds each; `epochs20`: the paper's "
              f"E = 20 local epochs, {ROUNDS['epochs20']} rounds; FedAvg with dafkd_fmnist's config, run here. "
              "`_detached` cells: the discriminators' negatives reach the heads only, never the shared extractors "
              "(`disc_negatives_grad=detached`). Figures: test accuracy (%), mean of the last 5 rounds, ± the "
              "standard deviation over seeds; differences paired by seed (± standard error), only between runs "
              f"that one machine made (each run folder's `machine.json`; a seed of another or an unnamed machine is left out, and "
              f"\"{OTHER_CPU}\" or \"{NO_CPU}\" stands where every seed is); n = 3 seeds unless said. Seconds a round: the median wall time of a "
              "round, each run on one CPU thread beside "
              "other runs (a cost, not a benchmark of speed; the median leaves out rounds stretched by pauses).", "",
              "| setting | cell | weights | data | accuracy | minus FedAvg | average before distillation | "
              "distillation's own effect | Eq. 7 entropy | s a round |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    present = [(setting, cell) for setting in SETTINGS for cell in CELLS if figs.get((cell, setting), {}).get("acc")]
    for setting, cell in present:
        f = figs[(cell, setting)]
        fedavg = figs.get(("fedavg", setting), {})
        spec = CELLS[cell]
        weights = spec.get("alpha_source", "—" if cell == "fedavg" else "discriminator")
        data = spec.get("distill_data", "—" if cell == "fedavg" else "generated")
        lines.append(f"| {setting} | {cell} | {weights} | {data} | {_mean(f['acc'])} | "
                     f"{'' if cell == 'fedavg' else _fmt(_paired(f, fedavg) if fedavg else None)} | "
                     f"{_mean(f['avg']) if f['avg'] else '—'} | "
                     f"{_fmt(_paired(f, f, 'acc', 'avg')) if f['avg'] else '—'} | {_mean(f['entropy'], 3)} | "
                     f"{_mean(f['round_s'], 0)} |")
    lines += ["", "## The mechanism, cell by cell", "",
              "Last-5 means ± standard deviation over seeds. Domain AUC: each client's discriminator ranking its own "
              "training images above the other clients' (0.5: cannot tell). Reader: the fixed LeNet-5 (86 % on the "
              "real test images) on the server's generated samples: the share it reads as the asked class (%; chance "
              "10), the normalised entropy of the classes it reads, the Frechet distance to the real test images. "
              "Ensembles: the round's local models weighed by Eq. 7 (the discriminators), by Eq. 7 at Theorem 1's "
              "optimal discriminators, and by the label shares, on real test images (%). D real/fake: the "
              "discriminators' accuracy on their own images and on generated ones (%). A dash: not recorded by that "
              "cell (the reader only on generated cells; runs recorded before the reader have none).", "",
              "| setting | cell | " + " | ".join(DIAG.values()) + " |", "|---|---|" + "---:|" * len(DIAG)]
    for setting, cell in present:
        f = figs[(cell, setting)]
        if cell != "fedavg":
            lines.append(f"| {setting} | {cell} | " + " | ".join(_mean(f.get(k, {}), 3 if k not in PERCENT else 1)
                                                             for k in DIAG) + " |")
    lines += ["", "## Which part loses the points", "",
              "Each contrast changes one part and keeps the rest (paired by seed, points of last-5 accuracy).", "",
              "| setting | contrast | what it isolates | difference |", "|---|---|---|---:|"]
    for setting in SETTINGS:
        for a, b, what in CONTRASTS:
            fa, fb = figs.get((a, setting)), figs.get((b, setting))
            if fa and fb and fa["acc"] and fb["acc"]:
                lines.append(f"| {setting} | {a} − {b} | {what} | {_fmt(_paired(fa, fb))} |")
    keys = ("eval/accuracy", "eval/accuracy_avg", "diag/domain_auc", "diag/reader_agreement")
    rows = {cell: by_round(grid, cell, "epochs20", keys) for cell in GRID["epochs20"]}
    if any(rows.values()):
        lines += ["", "## The paper's E = 20 local epochs (seed 0), round by round", "",
                  "Does the domain AUC or the reader's agreement rise with the paper's local work? Seconds a round: "
                  "wall time of the whole round on one CPU thread (local training of 8 clients, the server's "
                  "distillation, the evaluation and the diagnostics).", "",
                  "| cell | round | accuracy | average before distillation | domain AUC | reader agreement | s a round |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for cell, hist in rows.items():
            for r in hist:
                cols = [f"{100 * r[k]:.2f}" if k in r else "—" for k in ("eval/accuracy", "eval/accuracy_avg")]
                cols += [f"{r['diag/domain_auc']:.3f}" if "diag/domain_auc" in r else "—",
                         f"{100 * r['diag/reader_agreement']:.1f}" if "diag/reader_agreement" in r else "—",
                         f"{r['time/round_s']:.0f}" if "time/round_s" in r else "—"]
                lines.append(f"| {cell} | {r['round']} | " + " | ".join(cols) + " |")
        medians = [f"{cell} {figs[(cell, 'epochs20')]['round_s'][0]:.0f} s" for cell, hist in rows.items()
                   if hist and 0 in figs.get((cell, "epochs20"), {}).get("round_s", {})]
        lines += ["", "A round's wall time counts the pauses of a shared machine; the median round: "
                  + ", ".join(medians) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.grid_args(ap, NAME, list(CELLS), list(SETTINGS), rounds=60)
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST root (default: fedray's usual lookup)")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    opts = {"rounds": args.rounds, "data_dir": args.data_dir, "device": args.device, "threads": args.threads,
            "keep_models": args.keep_models}
    runs = planned(args.runs_dir, args.methods, args.settings, args.seeds)
    meta = harness.run_and_record(NAME, argv, args, build, runs, opts)
    table_runs = planned(args.runs_dir, list(CELLS), list(SETTINGS), (0, 1, 2))
    grid = harness.collect(table_runs)
    if not grid:
        raise SystemExit(f"no finished run in {args.runs_dir}")
    figs = figures(grid)
    md = markdown(figs, grid, meta, args.runs_dir, table_runs, args.rounds)
    harness.write(args.out, NAME, meta, {"cells": CELLS, "grid": {s: {c: list(v) for c, v in g.items()}
                                                                  for s, g in GRID.items()},
                                         "figures": {f"{c}/{s}": v for (c, s), v in figs.items()}}, md)
    print(md)


if __name__ == "__main__":
    main()
