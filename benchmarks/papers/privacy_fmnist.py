"""Accuracy against epsilon on Fashion-MNIST: what differential privacy costs FedAvg and the distillation methods, and
what a membership-inference attack still sees (issue: privacy benchmark; DaFKD's Sec. 3.2 claim).

Setting: real Fashion-MNIST, Dirichlet alpha = 0.5, ``--rounds`` rounds (30) for every method, ``--seeds`` (0 1 2),
each method on its own Fashion-MNIST preset's budget, as benchmarks/papers/adversaries_fmnist.py runs them:

- ``fedavg``: ``quickstart`` (K = 20, 8 a round, LeNet-5, 20 local SGD steps of batch 32, lr 0.01, momentum 0.9);
- ``fedcd``: ``fedcd_fmnist`` (K = 10, all every round, 50 labelled holdout images a class, Eq. 4's teacher) with
  LeNet-5 for every user; its accuracy the mean of its personal models', audited each on its own model;
- ``fedkf``: ``fedkf_fmnist`` at fedkf_fmnist.py's CPU budget (16 local steps of batch 64 at lr 0.05, 16 generated
  samples a step), its OCA model reported;
- ``dafkd``: ``dafkd_fmnist`` (K = 20, 8 a round, LeNet-5, a width-16 DCGAN generator, 20 local steps of batch 32,
  Adam); ``dafkd_private``: the same with ``private_discriminator=true`` (Appendix B: the discriminators stay on the
  clients, which send their weighted outputs on the distillation set instead: the same training, so it is run without
  DP, at ``eps4`` to show it trains as ``dafkd`` does, and under ``local16``, where what it sends matters).

Settings: ``none`` (no DP); ``eps1``, ``eps4``, ``eps16``: sample-level DP (DP-SGD, ``privacy.sample_clip=1``,
Poisson batches: each step every example with probability batch / n) on every update that reads a client's
examples (DaFKD: its classifier and discriminator, the generator as post-processing: Xin et al.'s DP GAN), with the
smallest sigma_s whose epsilon at delta = 1e-5 after the run's rounds is within the target for every client
(:func:`fedray.privacy.dpsgd.sample_noise_for`, dp-accounting's calibration), so each run ends at its epsilon;
``local16`` (DaFKD only): client-level DP, each upload clipped to 1 and noised before it leaves its client
(``privacy.mechanism=local``), sigma for epsilon 16 after the run's rounds (``noise_multiplier=auto``). Why
sample-level for the grid: with 8 clients a round, client-level noise on a whole model is sigma C on each of its
~60,000 coordinates against an update of norm C at most, which no method survives at these epsilons (``local16``
shows it once); with 20 clients of ~3,000 examples each, the examples are the unit to protect (cross-silo).

Every run audits membership (``privacy.mia_samples=500``: a loss-threshold attack, Yeom et al., on 500 of the
clients' training examples against the test set; ``diag/mia_auc``, 0.5 when it cannot tell them apart).

The record (``OUT/privacy_fmnist.md`` and ``.json``): per method and setting, accuracy (the mean of the last 5
evaluations, mean ± std over seeds), the epsilon the run ended at, sigma_s, the membership AUC (last 5), and
accuracy minus the no-DP run (paired by seed, one machine); DaFKD's claim read from its cells; a picture,
``OUT/privacy_fmnist.png``, of accuracy against epsilon per method.

    .venv/bin/python benchmarks/papers/privacy_fmnist.py --jobs 2            # the grid
    .venv/bin/python benchmarks/papers/privacy_fmnist.py --report-only       # the record from the runs
    .venv/bin/python benchmarks/papers/privacy_fmnist.py --rounds 2 --seeds 0 --settings none eps4 \\
        --out /tmp/dp --runs-dir /tmp/dp/runs                                 # smoke
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

import harness
from harness import Finished, Run, fmt_mean_std

NAME = "privacy_fmnist"
ALPHA = 0.5
DELTA = 1e-5
CLIP = 1.0
MIA_SAMPLES = 500
FEDCD_LENET = {"model.client_models": None, "model.name": "lenet5", "federation.eval_every": 2}
# method -> (its Fashion-MNIST preset, what changes)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "fedavg": ("quickstart", {}),
    "fedcd": ("fedcd_fmnist", FEDCD_LENET),
    "fedkf": ("fedkf_fmnist", {"federation.local_epochs": None, "federation.local_steps": 16,
                               "federation.lr": 0.05, "algorithm.generator_batch_size": 16,
                               "federation.eval_every": 2, "federation.eval_batch_size": 256}),
    "dafkd": ("dafkd_fmnist", {}),
    "dafkd_private": ("dafkd_fmnist", {"algorithm.private_discriminator": True}),
}
SAMPLE_EPSILONS = {"eps1": 1.0, "eps4": 4.0, "eps16": 16.0}
SETTINGS = ["none", *SAMPLE_EPSILONS, "local16"]
LOCAL_ONLY = ("dafkd", "dafkd_private")  # the client-level cell: DaFKD's claim names both kinds of DP
# Appendix B's variant computes Eq. 7's weights on the clients instead of the server: the same training, so under
# sample-level DP one epsilon shows it trains as dafkd does (its 2-round smoke run matched to 1e-5); what it sends
# differs, which the client-level cell measures
PRIVATE_SAMPLE = ("eps4",)
KEYS = {"accuracy": "eval/accuracy", "mia_auc": "diag/mia_auc"}


def grid() -> dict[str, list[str]]:
    return {m: [s for s in SETTINGS if (s != "local16" or m in LOCAL_ONLY)
                and (m != "dafkd_private" or s not in SAMPLE_EPSILONS or s in PRIVATE_SAMPLE)] for m in METHODS}


def planned(runs_dir: Path, methods, settings, seeds) -> list[Run]:
    cells = grid()
    return [Run(m, s, seed, Path(runs_dir) / harness.run_name(m, s, seed)) for seed in seeds for s in settings
            for m in methods if s in cells[m]]


@functools.lru_cache(maxsize=None)
def client_sizes(preset: str, spec_items: tuple, seed: int) -> tuple[int, ...]:
    """The clients' example counts of the run's partition (the accountant's worst client comes from them)."""
    from fedray.data import build_federated_data

    cfg = harness.preset_config(preset, dict(spec_items), {"seed": seed, "data.alpha": ALPHA,
                                                           "tracking.enabled": False})
    return tuple(build_federated_data(cfg.data, cfg.seed).client_sizes().tolist())


def privacy_overrides(method: str, setting: str, seed: int, rounds: int) -> dict[str, Any]:
    """``privacy.*`` of ``setting``: the audit always; DP-SGD with sigma_s calibrated to the target; or local noise."""
    from fedray.privacy.dpsgd import sample_noise_for

    out: dict[str, Any] = {"privacy.mia_samples": MIA_SAMPLES, "privacy.delta": DELTA}
    if setting in SAMPLE_EPSILONS:
        preset, spec = METHODS[method]
        base = harness.preset_config(preset, spec, {"seed": seed, "data.alpha": ALPHA, "tracking.enabled": False})
        sigma = sample_noise_for(base.federation, list(client_sizes(preset, tuple(spec.items()), seed)), DELTA,
                                 "poisson", SAMPLE_EPSILONS[setting], rounds)
        out.update({"privacy.sample_clip": CLIP, "privacy.sample_noise": sigma, "privacy.sample_batches": "poisson"})
    elif setting == "local16":
        out.update({"privacy.mechanism": "local", "privacy.clip": CLIP, "privacy.noise_multiplier": "auto",
                    "privacy.target_epsilon": 16.0})
    return out


def make_config(method: str, setting: str, seed: int, rounds: int, device: str = "cpu"):
    preset, spec = METHODS[method]
    return harness.preset_config(preset, spec, {
        "name": f"bench_{method}", "seed": seed, "data.alpha": ALPHA, "federation.rounds": rounds,
        "tracking.enabled": False, "runtime.backend": "local", "runtime.device": device,
        **privacy_overrides(method, setting, seed, rounds)})


def build(run: Run, opts: dict):
    return make_config(run.method, run.setting, run.seed, opts["rounds"], opts["device"])


# --- reading the runs ------------------------------------------------------------------------------------------


def _last(history: list[dict], key: str) -> float | None:
    for row in reversed(history):
        v = row.get(key)
        if isinstance(v, (int, float)) and not math.isnan(v):
            return float(v)
    return None


def collect(found: dict[tuple[str, str], list[Finished]]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for (method, setting), recs in found.items():
        for f in recs:
            out.setdefault(f"{method}|{setting}", []).append({
                "seed": f.seed, "dir": harness.shown(f.run.out), "cpu": harness.run_machine(f.run.out),
                **{name: harness.last_n(f.history, key) for name, key in KEYS.items()},
                "epsilon": _last(f.history, "privacy/sample_epsilon") if setting in SAMPLE_EPSILONS
                else _last(f.history, "privacy/epsilon"),
                "sigma": f.params.get("privacy.sample_noise") if setting in SAMPLE_EPSILONS else None,
                "round_s": f.summary.get("time/round_s")})
    return out


def paired(res: dict, method: str, a: str, b: str = "none") -> harness.Paired | str | None:
    ra, rb = res.get(f"{method}|{a}", []), res.get(f"{method}|{b}", [])
    by = lambda recs: {r["seed"]: 100 * r["accuracy"] for r in recs if r.get("accuracy") is not None}  # noqa: E731
    cpus = lambda recs: {r["seed"]: r.get("cpu") for r in recs}  # noqa: E731
    return harness.paired_by_seed(by(ra), by(rb), (cpus(ra), cpus(rb)))


def _cell(recs: list[dict], key: str, fmt: str) -> str:
    vals = [r[key] for r in recs if r.get(key) is not None]
    return format(float(np.mean(vals)), fmt) if vals else "—"


def method_table(res: dict, method: str, seeds: int) -> list[str]:
    preset, _ = METHODS[method]
    lines = [f"### {method} (preset `{preset}`)", "",
             "| setting | seeds | epsilon at the end | sigma_s | accuracy, last 5 (%) | minus no DP | membership AUC, "
             "last 5 |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for setting in grid()[method]:
        recs = res.get(f"{method}|{setting}", [])
        vs = "" if setting == "none" else harness.fmt_paired(paired(res, method, setting), seeds)
        eps = "∞" if setting == "none" else _cell(recs, "epsilon", ".2f")
        lines.append(f"| {setting} | {len(recs)} | {eps} | {_cell(recs, 'sigma', '.3f')} | "
                     f"{fmt_mean_std([r['accuracy'] for r in recs])} | {vs} | {_cell(recs, 'mia_auc', '.3f')} |")
    return lines + [""]


def dafkd_claim(res: dict, seeds: int) -> list[str]:
    """DaFKD Sec. 3.2: "the privacy risk ... can definitely be removed by combining it with differential privacy"
    without giving up the method: DaFKD's loss under each DP against FedAvg's under the same DP."""
    lines = ["## DaFKD under DP (Sec. 3.2)", "",
             "Each cell: accuracy minus the same method's no-DP run, paired by seed (points ± standard error); "
             "FedAvg's beside it under the same setting. Sample-level cells cover the examples' influence on every "
             "module a client trains (the discriminator and classifier by DP-SGD, the generator through them); "
             "`local16` covers each client's whole upload a round.", "",
             "| setting | DaFKD | DaFKD, private discriminator | FedAvg |", "| --- | ---: | ---: | ---: |"]
    for setting in SETTINGS[1:]:
        row = [harness.fmt_paired(paired(res, m, setting), seeds) if setting in grid()[m] else "not run"
               for m in ("dafkd", "dafkd_private", "fedavg")]
        lines.append(f"| {setting} | " + " | ".join(row) + " |")
    return lines + [""]


def picture(res: dict, out: Path) -> str | None:
    """Accuracy against epsilon (log axis; no DP at the right, a point of its own: no line joins it to the
    epsilons, so that a method run at a single epsilon draws no value where it was not run), one colour per method,
    ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    for i, m in enumerate(METHODS):
        points = {}  # x -> (mean, std); no DP drawn at x = 64
        for setting, eps in [*SAMPLE_EPSILONS.items(), ("none", 64.0)]:
            vals = [100 * r["accuracy"] for r in res.get(f"{m}|{setting}", []) if r.get("accuracy") is not None]
            if vals:
                points[eps] = (np.mean(vals), np.std(vals))
        style = {"marker": "o", "capsize": 3, "color": f"C{i}", "label": m}
        for xs in ([x for x in points if x != 64.0], [x for x in points if x == 64.0]):
            if xs:
                ax.errorbar(xs, [points[x][0] for x in xs], yerr=[points[x][1] for x in xs], **style)
                style["label"], drawn = None, True  # one legend entry a method
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 4, 16, 64], ["1", "4", "16", "no DP"])
    ax.set_xlabel("sample-level epsilon (delta = 1e-5)")
    ax.set_ylabel("accuracy, last 5 evaluations (%)")
    ax.set_title(f"Fashion-MNIST, alpha = {ALPHA:g}: accuracy against epsilon")
    ax.legend()
    fig.tight_layout()
    path = Path(out) / f"{NAME}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def markdown(res: dict, found: dict, meta: dict, runs_dir: Path, planned_runs: list[Run], seeds: int,
             png: str | None) -> str:
    lines = harness.header(f"Accuracy against epsilon on Fashion-MNIST α = {ALPHA:g}", meta, NAME, runs_dir,
                           planned_runs)
    lines += [f"Accuracy: `{KEYS['accuracy']}` (FedKF: its OCA model; FedCD: the mean of its personal models'), the "
              f"mean of a run's last {harness.LAST_N} evaluations, mean ± std over seeds. Epsilon: the last round's "
              "`privacy/sample_epsilon` (the worst client's, had it taken part every round) or `privacy/epsilon` "
              f"(local16), at delta = {DELTA:g}. Membership AUC: `{KEYS['mia_auc']}`, last 5, mean over seeds. "
              "Differences: points, paired by seed, one machine only; ± the standard error.", ""]
    if png:
        lines += [f"![accuracy against epsilon]({png})", ""]
    lines += ["## Each method", ""]
    for m in METHODS:
        lines += method_table(res, m, seeds)
    lines += harness.stopped(planned_runs, "the noise") + dafkd_claim(res, seeds)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.grid_args(ap, NAME, list(METHODS), SETTINGS, rounds=30)
    # noise that makes a model diverge stops its run (every upload non-finite): an outcome of the cell, recorded
    args, meta, table_runs, found = harness.run_planned(NAME, ap, sys.argv[1:] if argv is None else argv, planned,
                                                        build, failures_are_results=True)
    res = collect(found)
    png = picture(res, args.out)
    md = markdown(res, found, meta, args.runs_dir, table_runs, len(ap.get_default("seeds")), png)
    harness.write(args.out, NAME, meta, {"grid": grid(), "runs": res}, md)
    print(md)


if __name__ == "__main__":
    main()
