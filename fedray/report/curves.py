"""Learning curves of ``fedray report --plot``: per setting, one panel against the round and one against the MB
communicated so far (up and down), one line per method, the mean over seeds of a per-round metric with a band of
one sample std."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from fedray.errors import UserError
from fedray.report.runs import RunRecord, as_number, mean_std
from fedray.report.table import (DEFAULT_BY_METHOD, DEFAULT_BY_SETTING, METRIC_COLUMNS, Group, bytes_to_round,
                                 group_runs)
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
    nrows = 2 * math.ceil(n / ncols)  # per setting: against the round, and below it against the MB communicated
    fig = Figure(figsize=(5.0 * ncols, 3.4 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    for i, (setting, sgroups) in enumerate(settings.items()):
        by_round = fig.add_subplot(nrows, ncols, 2 * (i // ncols) * ncols + i % ncols + 1)
        by_mb = fig.add_subplot(nrows, ncols, (2 * (i // ncols) + 1) * ncols + i % ncols + 1)
        for g in sgroups:
            rounds, mean, std = mean_curve(g.runs, metric)
            if not rounds:
                continue
            m = [x * scale for x in mean]
            lo = [(x - s) * scale for x, s in zip(mean, std)]
            hi = [(x + s) * scale for x, s in zip(mean, std)]
            color = colors[g.method_label]
            for ax, xs in ((by_round, rounds), (by_mb, mean_megabytes(g.runs, rounds))):
                ax.plot(xs, m, color=color, marker="o" if len(rounds) < 30 else None, markersize=3,
                        label=f"{g.method_label} (n={len(g.runs)})")
                ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
        by_round.set_title(setting, fontsize=10)
        by_round.set_xlabel("round")
        by_round.xaxis.set_major_locator(MaxNLocator(integer=True))
        by_mb.set_xlabel("MB communicated (up + down)")
        for ax in (by_round, by_mb):
            ax.set_ylabel(f"{metric} {unit}".strip())
            ax.grid(alpha=0.3)
        by_round.legend(fontsize=8, loc="best")
    fig.suptitle(f"{metric}: mean ± std over seeds", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lstrip(".") or "png")
    return out

