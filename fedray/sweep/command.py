"""``fedray tune`` once its input is checked (:func:`fedray.cli.cmd_tune`): the dry run's plan, or the sweep and its
best trial's table. Ray is imported only past the dry run, so a dry run starts nothing."""

from __future__ import annotations

import argparse
import os
import time

from fedray.record.console import comparison_table, make_console
from fedray.record.provenance import command_line
from fedray.sweep.spec import SweepSpec, format_bundles, planned_trials, search_plan, selects_on_test_data


def tune(spec: SweepSpec, args: argparse.Namespace) -> int:
    """Print the trials and their resources (``--dry-run``), or run the sweep and print its best trial."""
    console = make_console()
    trials = planned_trials(spec, args.num_samples)
    if selects_on_test_data(spec):
        console.print(f"note: {spec.metric} is scored on test data, so the best trial is chosen on it; to choose "
                      "hyperparameters, hold out a validation set (data.val_per_class) and use metric: val/accuracy",
                      highlight=False)
    if spec.scheduler is not None and "seed" in spec.search:
        console.print("note: ASHA stops each seed's trial on its own, so a setting's mean over its seeds may mix "
                      "stopped and finished trials; compare settings over seeds without a scheduler", highlight=False)
    if args.dry_run:
        setting = ["setting"] if spec.search_method == "optuna" else []  # each proposed setting runs every seed
        rows = [{"trial": t["trial"], "setting": t["sample"], **{k: str(v) for k, v in t["values"].items()},
                 "bundles": format_bundles(t["bundles"])} for t in trials]
        cpus = sum(b.get("CPU", 0.0) for b in trials[0]["bundles"])
        fits = int((os.cpu_count() or 1) // cpus) if cpus else None
        at_once = [n for n in (fits, args.max_concurrent or spec.max_concurrent) if n]
        console.print(comparison_table(rows, ["trial", *setting, *spec.search, "bundles"],
                                       title=f"{spec.name}: {len(trials)} trials, metric {spec.metric} ({spec.mode})"))
        console.print(search_plan(spec, args.num_samples, min(at_once) if at_once else None), highlight=False)
        where = ("none fits" if fits == 0 else f"{min(at_once) if at_once else '?'} at once") + " on this machine"
        console.print(f"each trial reserves {cpus:g} CPU: {where} ({os.cpu_count()} CPUs); nothing was started",
                      highlight=False)
        return 0
    from fedray.sweep.runner import latest_sweep, run_sweep  # imports Ray: after validation

    stem = spec.name
    if args.name:
        spec.name = args.name
    elif args.resume:
        spec.name = latest_sweep(stem, spec.storage) or stem
    else:
        spec.name = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    console.print(f"sweep {spec.name}: {len(trials)} trials, metric {spec.metric} ({spec.mode})", highlight=False)
    best = run_sweep(spec, resume=args.resume, max_concurrent=args.max_concurrent, num_samples=args.num_samples,
                     address=args.address, verbose=args.verbose, console=console,
                     source=command_line(getattr(args, "argv", [])))
    rows = [{"key": k, "value": v} for k, v in best["config"].items()]
    what = "trial"
    if best["metric_value"] is not None:  # what the choice was made by, then the last round's figures
        rows.append({"key": f"{spec.metric}, {best['metric_rounds']}", "value": best["metric_value"]})
    if "seeds" in best:  # a seed dimension: the best setting by its mean over seeds, figures averaged
        what = f"setting (mean over seeds {', '.join(map(str, best['seeds']))})"
        rows.append({"key": f"{spec.metric}, std over seeds", "value": best["metric_std"]})
    rows += [{"key": k, "value": v} for k, v in sorted(best["metrics"].items())]
    console.print(comparison_table(rows, ["key", "value"], title=f"best {what} of {spec.name} "
                                   f"({best['trials']} trials, {best['errored']} failed)"))
    console.print(f"saved to {spec.storage}/{spec.name}/best.json", highlight=False)
    return 0
