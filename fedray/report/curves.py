"""Learning curves of ``fedray report --plot``: per setting, one panel against the round, one against the MB
communicated so far (up and down) and, for runs with a simulated system, one against the simulated hours; one line
per method, the mean over seeds of a per-round metric with a band of one sample std."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from fedray.errors import UserError
from fedray.report.runs import RunRecord, as_number, mean_std
from fedray.report.table import (DEFAULT_BY_METHOD, DEFAULT_BY_SETTING, METRIC_COLUMNS, Group, bytes_to_round,
                                 group_runs, sim_hours_at)
from fedray.record.run_dir import HISTORY_FILE


def _metric_scale(metric: str) -> tuple[float, str]:
    for key, header, scale, _ in METRIC_COLUMNS:
        if key == metric:
            return scale, header.split(" ", 1)[1] if " " in header else ""
    return 1.0, ""


def mean_curve(runs: Sequence[RunRecord], metric: str) -> tuple[list[int], list[float], list[float]]:
    """Rounds where some seed evaluated ``metric``, and the mean / sample std over those seeds."""
    per_round: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for row in run.history:
            v = as_number(row.get(metric))
            if v is not None and row.get("round") is not None:
                per_round[int(row["round"])].append(v)
    rounds = sorted(per_round)
    stats = [mean_std(per_round[r]) for r in rounds]
    return rounds, [m for m, _ in stats], [s for _, s in stats]


def mean_megabytes(runs: Sequence[RunRecord], rounds: Sequence[int]) -> list[float]:
    """For each of ``rounds``: the MB sent up and down until the end of that round (the report's
    :func:`~fedray.report.table.bytes_to_round`), mean over the runs that got that far."""
    out = []
    for r in rounds:
        mb = [bytes_to_round(run.history, r) / 1e6 for run in runs if any(row.get("round") == r for row in run.history)]
        out.append(sum(mb) / len(mb) if mb else math.nan)
    return out


def mean_sim_hours(runs: Sequence[RunRecord], rounds: Sequence[int]) -> list[float] | None:
    """For each of ``rounds``: the simulated clock in hours at its end, mean over the runs that got that far; None
    when no run has a simulated system."""
    out = []
    for r in rounds:
        hours = [h for h in (sim_hours_at(run.history, r) for run in runs) if h is not None]
        out.append(sum(hours) / len(hours) if hours else math.nan)
    return out if any(not math.isnan(h) for h in out) else None


def plot_curves(
    runs: Sequence[RunRecord],
    path: str | Path,
    by_method: Sequence[str] = DEFAULT_BY_METHOD,
    by_setting: Sequence[str] = DEFAULT_BY_SETTING,
    metric: str = "eval/accuracy",
) -> Path:
    """One subplot per setting, one line per method: the mean over seeds of ``metric`` per evaluated
    round, with a band of ± one sample std. Uses the Agg canvas directly (no pyplot, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not runs:
        raise UserError("RUNS", "no finished runs to plot; give run directories or an MLflow experiment")
    groups = group_runs(runs, by_method, by_setting)
    settings: dict[str, list[Group]] = {}
    for g in groups:
        settings.setdefault(g.setting_label, []).append(g)
    if not any(mean_curve(g.runs, metric)[0] for g in groups):
        raise UserError(
            "--plot", f"no run recorded '{metric}' per round ({HISTORY_FILE} / MLflow metrics); nothing to plot"
        )
    methods = list(dict.fromkeys(g.method_label for g in groups))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    scale, unit = _metric_scale(metric)

    n = len(settings)
    ncols = min(n, 3)
    timed = any(mean_sim_hours(g.runs, mean_curve(g.runs, metric)[0]) for g in groups)
    views = 3 if timed else 2  # per setting: against the round, below it the MB communicated, then simulated hours
    nrows = views * math.ceil(n / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.4 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    for i, (setting, sgroups) in enumerate(settings.items()):
        axes = [fig.add_subplot(nrows, ncols, (views * (i // ncols) + v) * ncols + i % ncols + 1) for v in range(views)]
        for g in sgroups:
            rounds, mean, std = mean_curve(g.runs, metric)
            if not rounds:
                continue
            m = [x * scale for x in mean]
            lo = [(x - s) * scale for x, s in zip(mean, std)]
            hi = [(x + s) * scale for x, s in zip(mean, std)]
            color = colors[g.method_label]
            xs_of = [rounds, mean_megabytes(g.runs, rounds)]
            if timed:
                xs_of.append(mean_sim_hours(g.runs, rounds) or [math.nan] * len(rounds))
            for ax, xs in zip(axes, xs_of):
                ax.plot(xs, m, color=color, marker="o" if len(rounds) < 30 else None, markersize=3,
                        label=f"{g.method_label} (n={len(g.runs)})")
                ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
        axes[0].set_title(setting, fontsize=10)
        axes[0].set_xlabel("round")
        axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[1].set_xlabel("MB communicated (up + down)")
        if timed:
            axes[2].set_xlabel("simulated hours (system.*)")
        for ax in axes:
            ax.set_ylabel(f"{metric} {unit}".strip())
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(f"{metric}: mean ± std over seeds", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lstrip(".") or "png")
    return out

