"""FedCD's communication question (its Table III) asked against a compressed FedAvg, on phones that come and go
(issue 67; the channel's stages: docs/channel.md).

FedCD (Ahmad and Aral) reports 10 MB against FedAvg's 37,928 MB, a FedAvg that sends full-precision weights. This
benchmark adds the FedAvg a practitioner would ship: 8-bit QSGD (Alistarh et al. 2017) and top-1 % sparsification
with error feedback (Stich et al. 2018; Karimireddy et al. 2019).

Setting: system_fmnist's (the quickstart preset, Fashion-MNIST, Dirichlet alpha=0.1 over 40 clients, LeNet-5, 8
clients a round of 20 local steps, batch 32, SGD lr 0.01 momentum 0.9, ``--rounds`` rounds, ``--seeds``), with its
phones (the ``heterogeneous`` device profile, Markov availability, 1 h online / 1 h offline on average, a server of
5,000 samples/s), so that fewer bytes also mean shorter simulated rounds. Methods:

- ``fedavg``: full-precision weights both ways;
- ``fedavg_q8``: uploads (the update against the model the client was sent) at 8 bits, QSGD, a scale per 512
  elements; ``fedavg_q8_both``: the same on the payloads too (the model sent down as its values at 8 bits);
- ``fedavg_top1_ef``: uploads as the top 1 % of each tensor's update, the rest kept as the client's residual (error
  feedback). Uplink only: top-k on the payload would send a sparse model (1 % of its weights, the others zero) that
  the clients then train from, not an update (docs/channel.md);
- ``fedkf``: its cached aggregate (OCA) reported, as in system_fmnist;
- ``fedcd``: personal LeNet-5s distilled on a 500-image labelled holdout, as in system_fmnist; ``fedcd_q8``: its
  uploaded logits at 8 bits (QSGD, as values: logits have no reference model).

Accuracy: the global model's on the test set, FedCD's the mean of its personal models' (as its paper reports it);
the table's "accuracy of" column says which. Per method and target: rounds, MB (up + down) and simulated hours
until the accuracy first reaches it, the mean over the seeds that reach it. Targets: system_fmnist's 40 % and 50 %,
and 30 %, which FedCD's personal models reach (they stay under 40 % in system_fmnist: 37.2 ± 1.9 %). Per MB budget
(``--budget-mb``): the accuracy at the last evaluated round whose cumulative MB up + down is within it, mean ± std
over the seeds that have one. Default budgets: 10 MB (FedCD's Table III total; more than FedCD's whole run here,
about 1.4 MB, so its row is its final accuracy; two rounds of plain FedAvg) and 50 MB (under half of plain
FedAvg's 30 rounds, ~118 MB: the compressed FedAvgs have run most or all of theirs). FedCD's one-off handing of
the holdout images to every client (``comm/bytes_setup``, ~16 MB) is not in MB up + down (system_fmnist's measure);
a column shows it, and the ratios below are given without and with it. The ratios: each compressed FedAvg's MB to
a target over FedCD's (and FedCD with 8-bit logits'), the figure docs/reproducing.md's FedCD row quotes.

    .venv/bin/python benchmarks/papers/compression_fmnist.py --jobs 2
    .venv/bin/python benchmarks/papers/compression_fmnist.py --report-only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import harness
from harness import LAST_N, Finished, Run
from harness import fmt_mean_std as mean_std

NAME = "compression_fmnist"
# system_fmnist's phones and its FedAvg, FedKF and FedCD, as there
PHONES = {"system.devices": "heterogeneous", "system.availability": "markov", "system.mean_online_s": 3600.0,
          "system.mean_offline_s": 3600.0, "system.server_sps": 5000.0}
FEDAVG = {"algorithm": {"name": "fedavg"}}
FEDCD = {"algorithm": {"name": "fedcd"}, "data.server_data.kind": "holdout", "data.server_data.per_class": 50}
Q8 = {"channel.quantize": "qsgd", "channel.bits": 8}
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": FEDAVG,
    "fedavg_q8": {**FEDAVG, **Q8},
    "fedavg_q8_both": {**FEDAVG, **Q8, "channel.compress_on": "both"},
    # uplink only: a top-k payload is a sparse model the clients would train from
    "fedavg_top1_ef": {**FEDAVG, "channel.sparsify": "topk", "channel.fraction": 0.01, "channel.error_feedback": True},
    "fedkf": {"algorithm": {"name": "fedkf", "report_model": "oca"}},
    "fedcd": FEDCD,
    "fedcd_q8": {**FEDCD, **Q8},  # its uploaded logits at 8 bits
}
COMPRESSED_FEDAVG = ("fedavg_q8", "fedavg_q8_both", "fedavg_top1_ef")
PERSONAL = ("fedcd", "fedcd_q8")  # accuracy: the mean of the personal models'
SETTINGS: dict[str, dict[str, Any]] = {"alpha0.1": {}}
TARGETS = (0.3, 0.4, 0.5)  # system_fmnist's 40 % and 50 %, and 30 %, which FedCD's personal models reach
BUDGETS_MB = (10.0, 50.0)


def make_config(method: str, setting: str, seed: int, rounds: int, device: str):
    return harness.preset_config("quickstart", METHODS[method], {
        "name": f"bench_{method}", "seed": seed, "data.num_clients": 40, "federation.rounds": rounds,
        "tracking.enabled": False, "runtime.device": device, **PHONES, **SETTINGS[setting]})


def build(run: Run, opts: dict):
    return make_config(run.method, run.setting, run.seed, opts["rounds"], opts["device"])


def accuracy_within(history: list[dict], budget_mb: float) -> tuple[int | None, float | None]:
    """The last evaluated round whose cumulative MB up + down is within ``budget_mb``, and its accuracy; (None, None)
    when no evaluated round is."""
    from fedray.report.runs import as_number

    sent, best = 0.0, (None, None)
    for r in sorted(history, key=lambda r: r.get("round", 0)):
        sent += (as_number(r.get("comm/bytes_up")) or 0.0) + (as_number(r.get("comm/bytes_down")) or 0.0)
        if sent > budget_mb * 1e6:
            break
        acc = as_number(r.get("eval/accuracy"))
        if acc is not None:
            best = (r["round"], acc)
    return best


def collect(grid: dict[tuple[str, str], list[Finished]], budgets: tuple[float, ...] = BUDGETS_MB) -> dict:
    res: dict[str, list[dict]] = {}
    for (method, setting), recs in grid.items():
        for f in recs:
            hist = f.history
            reach = harness.reach(hist, TARGETS)
            within = {}
            for b in budgets:
                r, acc = accuracy_within(hist, b)
                within[f"{b:g}"] = {"round": r, "accuracy": acc}
            res.setdefault(f"{method}|{setting}", []).append({
                "seed": f.seed, "accuracy": f.summary["eval/accuracy"], "last_n": harness.last_n(hist),
                "hours": f.summary.get("sim/clock_s", 0.0) / 3600.0, "reach": reach, "budget": within,
                "mb": (f.summary["comm/bytes_up"] + f.summary["comm/bytes_down"]) / 1e6,
                "setup_mb": f.summary.get("comm/bytes_setup", 0.0) / 1e6})
    return res


def _within(rs: list[dict], budget: float) -> tuple[str, str]:
    cells = [r["budget"][f"{budget:g}"] for r in rs]
    hits = [c for c in cells if c["accuracy"] is not None]
    if not hits:
        return f"— (0/{len(cells)})", "0"
    acc = mean_std([c["accuracy"] for c in hits])
    rounds = sum(c["round"] for c in hits) / len(hits)
    return (acc if len(hits) == len(cells) else f"{acc} ({len(hits)}/{len(cells)})"), f"{rounds:.1f}"


def ratios(res: dict) -> list[str]:
    """Each compressed FedAvg's mean MB to a target over FedCD's (and FedCD with 8-bit logits'), where both reach
    it with every seed; then with FedCD's setup bytes added to its MB."""
    def full(method: str, t: float) -> float | None:
        rs = res.get(f"{method}|alpha0.1", [])
        m, _ = harness.mean_reached(rs, t, "mb", 1) if rs else (None, "")
        return m if m is not None and all(r["reach"][str(t)]["mb"] is not None for r in rs) else None

    lines = []
    for cd in PERSONAL:
        rs_cd = res.get(f"{cd}|alpha0.1", [])
        if not rs_cd:
            continue
        setup = sum(r["setup_mb"] for r in rs_cd) / len(rs_cd)
        for t in TARGETS:
            cd_mb = full(cd, t)
            parts = []
            for fa in ("fedavg", *COMPRESSED_FEDAVG):
                fa_mb = full(fa, t)
                if cd_mb is None or fa_mb is None or cd_mb <= 0:
                    parts.append(f"{fa} —")
                else:
                    parts.append(f"{fa} {fa_mb / cd_mb:,.1f}x ({fa_mb / (cd_mb + setup):,.2f}x with setup)")
            lines.append(f"- {100 * t:g}%, MB over {cd}'s: " + "; ".join(parts))
    return lines


def tables(res: dict, meta: dict, runs_dir: Path, planned: list[Run], budgets: tuple[float, ...] = BUDGETS_MB) -> str:
    lines = harness.header("FedCD's communication against a compressed FedAvg on Fashion-MNIST alpha=0.1, phones "
                           "that come and go", meta, NAME, runs_dir, planned)
    lines += [f"Accuracy (%) of the global model, FedCD's: the mean of its personal models' (column \"accuracy of\"): "
              f"last evaluation / mean of the last {LAST_N}, mean ± std over seeds. Per target: rounds, MB sent (up + "
              "down) and simulated hours until the first evaluation at or above it, mean over the seeds that reach it "
              "(their count when not all). Per budget: the accuracy at the last evaluated round whose cumulative MB "
              "(up + down) is within it, and that round, over the seeds that have one. MB and simulated hours of the "
              "whole run and setup MB (FedCD's holdout images handed to every client once, not in MB up + down): "
              "mean over seeds.", "",
              "| method | accuracy of | seeds | accuracy | last 5 | " + " | ".join(
                  f"rounds to {100 * t:g}% | MB to {100 * t:g}% | sim h to {100 * t:g}%" for t in TARGETS)
              + " | " + " | ".join(f"accuracy at {b:g} MB | round at {b:g} MB" for b in budgets)
              + " | MB, whole run | setup MB | sim h, whole run |",
              "| --- | --- | ---: | ---: | ---: | " + " | ".join(["---:"] * (3 * len(TARGETS) + 2 * len(budgets)))
              + " | ---: | ---: | ---: |"]
    for method in METHODS:
        rs = res.get(f"{method}|alpha0.1", [])
        if not rs:
            continue
        cells = [harness.mean_reached(rs, t, what, 1)[1] for t in TARGETS for what in ("rounds", "mb", "hours")]
        cells += [c for b in budgets for c in _within(rs, b)]
        n = len(rs)
        lines.append(f"| {method} | {'personal' if method in PERSONAL else 'global'} | {n} | "
                     f"{mean_std([r['accuracy'] for r in rs])} | {mean_std([r['last_n'] for r in rs])} | "
                     f"{' | '.join(cells)} | {sum(r['mb'] for r in rs) / n:,.1f} | "
                     f"{sum(r['setup_mb'] for r in rs) / n:,.1f} | {sum(r['hours'] for r in rs) / n:.2f} |")
    lines += ["", "MB to each target of FedAvg, plain and compressed, over FedCD's (methods that reached it with every "
              "seed; — otherwise); in brackets with FedCD's setup MB added to its own:", "",
              *(ratios(res) or ["- none"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.grid_args(ap, NAME, list(METHODS), list(SETTINGS), rounds=30)
    ap.add_argument("--budget-mb", type=float, nargs="+", default=list(BUDGETS_MB),
                    help="MB budgets (up + down) at which the table gives each method's accuracy")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    opts = {"rounds": args.rounds, "device": args.device, "threads": args.threads, "keep_models": args.keep_models}
    meta, table_runs = harness.run_grid(NAME, argv, ap, args, build, opts)
    budgets = tuple(args.budget_mb)
    res = collect(harness.collect(table_runs), budgets)
    md = tables(res, meta, args.runs_dir, table_runs, budgets)
    harness.write(args.out, NAME, meta, {"runs": res}, md)
    print(md)


if __name__ == "__main__":
    main()
