"""``fedray report``: compare finished runs in the papers' table form, and plot their learning curves.

:mod:`fedray.report.runs` loads finished runs (output directories or an MLflow experiment) as
:class:`RunRecord`; :mod:`fedray.report.table` aggregates them over seeds into the papers' table form, and
:mod:`fedray.report.curves` plots their learning curves. :mod:`fedray.report.clients` reports one run's clients
round by round (``--clients``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from fedray.errors import UserError
from fedray.report.runs import RunRecord, fill_algorithm_defaults, load_mlflow_runs, load_run_dirs, parse_value
from fedray.report.curves import plot_curves
from fedray.report.table import DEFAULT_BY_METHOD, DEFAULT_BY_SETTING, build_table, to_markdown
from fedray.record.run_dir import SUMMARY_FILE

__all__ = ["RunRecord", "fill_algorithm_defaults", "build_table", "load_mlflow_runs", "load_run_dirs", "parse_value",
           "plot_curves", "report", "to_markdown"]


def report(
    sources: Sequence[str] | None,
    experiment: str | None,
    tracking_uri: str | None,
    by_method: Sequence[str] = DEFAULT_BY_METHOD,
    by_setting: Sequence[str] = DEFAULT_BY_SETTING,
    target: float | None = None,
    out: str | None = None,
    plot: str | None = None,
) -> str:
    """Load runs from run directories and/or an MLflow experiment, return the markdown comparison table;
    write it to ``out`` and the learning curves to ``plot`` when asked."""
    sources = list(sources or [])
    if not sources and not experiment:
        raise UserError("RUNS", "nothing to report; give run directories (or folders of them) and/or --experiment NAME")
    by_method = tuple(by_method or DEFAULT_BY_METHOD)
    by_setting = tuple(by_setting or ())
    if target is not None and not (0 < target <= 100):
        raise UserError("--target", f"{target} is not an accuracy; give a fraction in (0, 1] or a percentage")
    runs = load_run_dirs(sources) if sources else []
    if experiment:
        in_dirs = {r.run_id for r in runs if r.run_id}
        tracked = load_mlflow_runs(experiment, tracking_uri)
        runs += [r for r in tracked if r.run_id not in in_dirs]  # a run given both ways counts once
    if not runs:
        where = " and ".join(
            x for x in (", ".join(sources) if sources else "", f"experiment '{experiment}'" if experiment else "") if x
        )
        raise UserError("RUNS", f"no finished runs found in {where}; a finished run directory holds {SUMMARY_FILE}")
    for option, keys in (("--by-method", by_method), ("--by-setting", by_setting)):
        unknown = [k for k in keys if not any(k in r.params for r in runs)]
        if unknown:  # a typo would otherwise group every run under "key=—"
            raise UserError(option, f"{', '.join(unknown)}: no run has such a config key; keys are dotted as in "
                            "config.yaml, e.g. algorithm.name, data.alpha, model.name")
    rows = build_table(runs, by_method, by_setting, target)
    text = to_markdown(rows)
    if out:
        out_path = Path(out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text)
    if plot:
        plot_curves(runs, plot, by_method, by_setting)
    return text

