"""DaFKD taken apart on real Fashion-MNIST (alpha = 0.1): which part loses the points against FedAvg, Eq. 7's
weights, the generated distillation data, or distillation itself?

A 2 x 3 grid of DaFKD (``algorithm.alpha_source`` x ``algorithm.distill_data``) beside FedAvg, on
``dafkd_fmnist``'s reduced budget (LeNet-5, K=20, 8 a round, 20 local Adam steps of batch 32, 60 rounds) with
the paper's conditional generator (the oracle needs each generated sample's class):

- ``disc_generated``: the method (Eq. 7 from the discriminators, on generated samples);
- ``oracle_generated`` / ``uniform_generated``: the label-share oracle (``alpha_source=label_share``: each client's
  share of the sample's class, not Theorem 1's optimum) / uniform weights, generated;
- ``disc_proxy`` / ``oracle_proxy`` / ``uniform_proxy``: the same weights, distilled on real unlabelled images
  (500 a class held by the server, copied so that the clients' data is FedAvg's; labelled only for the
  oracle, which reads the labels; the distillation never does);
- ``authors_head``: the authors' code where it differs cheaply (one discriminator head for all clients, here averaged by the server,
  adversarial training only in rounds 1-3 / 1-5), seed 0 beside the method;
- ``theorem1_generated`` / ``theorem1_proxy``: Eq. 7 at Theorem 1's optimal discriminators under the run's label
  distributions (``alpha_source=theorem1``), the ceiling of the discriminators' weights;
- ``ceiling_generated``: the discriminators trained against real images of every client's data instead of the
  generator's samples (``disc_negatives=pooled``: Eq. 7 as if the generator had reached p; breaks privacy);
- ``classterm_generated``: the generator also trained to make the client's classifier read G(z, y) as y
  (``gen_class_weight=1``, an extension): do samples that show their class rescue the method?

Every generated cell scores its samples with the fixed reader (``diag_reader``: ``diag/reader_*``).
- ``fedavg``: ``dafkd_fmnist.py``'s FedAvg runs (the same config), read from its run folders.

Settings: ``steps20`` (3 seeds), ``steps200`` (10x the local steps, seed 0: the 2 x 3 grid and FedAvg) and
``epochs20`` (the paper's E = 20 local epochs, 12 rounds, seed 0: the method and FedAvg, diagnostics on: do the
domain AUC and the reader's agreement rise with the paper's local work?). Every DaFKD run also evaluates its plain average before distillation
(``eval/accuracy_avg``), which separates what the distillation does from what the clients did.

Cost on the 2-core CPU, one thread a run: ~46-51 s a round for DaFKD at 200 steps (~50 min a run), ~9 s for
FedAvg; more seeds at 200 steps add as much each (extend GRID["steps200"]).

    .venv/bin/python benchmarks/papers/dafkd_decomposition.py --settings steps20 --jobs 2   # the 3-seed grid
    .venv/bin/python benchmarks/papers/dafkd_decomposition.py --settings steps200 --jobs 2  # 10x local steps
    .venv/bin/python benchmarks/papers/dafkd_decomposition.py --settings epochs20 --jobs 2  # E = 20, hours
    .venv/bin/python benchmarks/papers/dafkd_decomposition.py --report-only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

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
    "classterm_generated": {"alpha_source": "discriminator", "distill_data": "generated", "gen_class_weight": 1.0},
}
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
        "steps200": {c: (0,) for c in CELLS if c != "authors_head"},
        "epochs20": {"fedavg": (0,), "disc_generated": (0,)}}
FEDAVG_RUNS = harness.RESULTS / "dafkd_fmnist_runs"  # steps20's FedAvg: dafkd_fmnist.py's runs


def planned(runs_dir: Path, cells, settings, seeds) -> list[Run]:
    """The grid's runs (of the asked cells, settings and seeds); FedAvg at 20 steps in dafkd_fmnist.py's folders."""
    runs = []
    for setting in settings:
        for cell, cell_seeds in GRID[setting].items():
            for seed in cell_seeds:
                if cell in cells and seed in seeds:
                    out = (FEDAVG_RUNS / f"fedavg_alpha0.1_seed{seed}" if (cell, setting) == ("fedavg", "steps20")
                           else runs_dir / harness.run_name(cell, setting, seed))
                    runs.append(Run(cell, setting, seed, out))
    return runs


def make_config(cell: str, setting: str, seed: int, rounds: int, data_dir: str | None, device: str):
    from fedray.config import validate_config
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


def _paired(a: dict[int, float], b: dict[int, float]) -> tuple[float, float | None, int] | None:
    """mean(a - b) over the seeds both have, its standard error (None for one seed), and how many."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    d = [a[s] - b[s] for s in seeds]
    return float(np.mean(d)), (float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None), len(d)


def _fmt(p: tuple[float, float | None, int] | None) -> str:
    if p is None:
        return "—"
    mean, se, n = p
    return f"{mean:+.2f}" + (f" ± {se:.2f}" if se is not None else "") + (f" (n={n})" if n != 3 else "")


def figures(grid) -> dict[tuple[str, str], dict[str, dict[int, float]]]:
    """Per (cell, setting): seed -> last-5 test accuracy (%), of the average before distillation, and the diag."""
    out = {}
    for (cell, setting), recs in grid.items():
        fig: dict[str, dict[int, float]] = {"acc": {}, "avg": {}, "entropy": {}}
        for f in recs:
            fig["acc"][f.seed] = 100 * harness.last_n(f.history, "eval/accuracy")
            avg = harness.last_n(f.history, "eval/accuracy_avg")
            if avg is not None:
                fig["avg"][f.seed] = 100 * avg
            ent = harness.last_n(f.history, "server/alpha_entropy")
            if ent is not None:
                fig["entropy"][f.seed] = ent
        out[(cell, setting)] = fig
    return out


def markdown(figs, meta: dict, runs_dir: Path, planned_runs: list[Run], rounds: int) -> str:
    lines = harness.header("DaFKD decomposed: weights, generated data, or distillation itself (Fashion-MNIST, "
                           "alpha = 0.1)", meta, NAME, runs_dir, planned_runs)
    lines += ["LeNet-5, K=20, 8 clients a round, Adam lr 1e-3, batch 32, the conditional generator, "
              f"{rounds} rounds; `steps20`: 20 local steps (dafkd_fmnist's budget), `steps200`: 10x. Figures: "
              "test accuracy (%), mean of the last 5 rounds; differences paired by seed (± standard error).", "",
              "| setting | cell | weights | data | accuracy | minus FedAvg | average before distillation | "
              "distillation's own effect | Eq. 7 entropy |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for setting in SETTINGS:
        fedavg = figs.get(("fedavg", setting), {}).get("acc", {})
        for cell in CELLS:
            f = figs.get((cell, setting))
            if not f or not f["acc"]:
                continue
            vals = list(f["acc"].values())
            acc = f"{np.mean(vals):.2f}" + (f" ± {np.std(vals, ddof=1):.2f}" if len(vals) > 1 else "") \
                + (f" (n={len(vals)})" if len(vals) != 3 else "")
            spec = CELLS[cell]
            weights = spec.get("alpha_source", "—" if cell == "fedavg" else "discriminator")
            data = spec.get("distill_data", "—" if cell == "fedavg" else "generated")
            avg = f"{np.mean(list(f['avg'].values())):.2f}" if f["avg"] else "—"
            ent = f"{np.mean(list(f['entropy'].values())):.3f}" if f["entropy"] else "—"
            lines.append(f"| {setting} | {cell} | {weights} | {data} | {acc} | "
                         f"{'' if cell == 'fedavg' else _fmt(_paired(f['acc'], fedavg))} | {avg} | "
                         f"{_fmt(_paired(f['acc'], f['avg'])) if f['avg'] else '—'} | {ent} |")
    lines += ["", "## Which part loses the points", "",
              "Each contrast changes one part and keeps the rest (paired by seed, points of last-5 accuracy).", "",
              "| setting | contrast | what it isolates | difference |", "|---|---|---|---:|"]
    contrasts = [("oracle_generated", "disc_generated", "label-share weights instead of the discriminators'"),
                 ("uniform_generated", "disc_generated", "uniform weights instead of the discriminators'"),
                 ("uniform_proxy", "disc_proxy", "uniform weights instead of the discriminators', on real images"),
                 ("disc_proxy", "disc_generated", "real images instead of generated ones"),
                 ("oracle_proxy", "oracle_generated", "real images instead of generated ones, label-share weights"),
                 ("oracle_proxy", "fedavg", "the best distillation can do here against FedAvg"),
                 ("authors_head", "disc_generated", "one head for all and early-only adversarial training (authors' code)")]
    for setting in SETTINGS:
        for a, b, what in contrasts:
            fa, fb = figs.get((a, setting)), figs.get((b, setting))
            if fa and fb:
                lines.append(f"| {setting} | {a} − {b} | {what} | {_fmt(_paired(fa['acc'], fb['acc']))} |")
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
    md = markdown(figs, meta, args.runs_dir, table_runs, args.rounds)
    harness.write(args.out, NAME, meta, {"cells": CELLS, "grid": {s: {c: list(v) for c, v in g.items()}
                                                                  for s, g in GRID.items()},
                                         "figures": {f"{c}/{s}": v for (c, s), v in figs.items()}}, md)
    print(md)


if __name__ == "__main__":
    main()
