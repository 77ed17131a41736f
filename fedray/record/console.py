"""Terminal output: the per-run progress bar, the result and comparison tables, and how values print.

Everything here writes to a terminal (or a pipe); nothing is written to a run's directory
(:mod:`fedray.record.run_dir`) or to MLflow (:mod:`fedray.record.tracking`).
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def format_value(value: Any) -> str:
    """A table cell: ``-`` for a missing value or NaN, 4 decimals for small floats, thousands separators
    for large ones."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


class ConsoleReporter:
    """A progress bar advanced once per round, showing the latest accuracy."""

    def __init__(self, total_rounds: int, title: str, enabled: bool = True, console: Console | None = None,
                 done: int = 0):
        self.console = console or make_console(stderr=True)
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not enabled,
        )
        self.task = self.progress.add_task(title, total=total_rounds, acc="-", completed=done)

    def __enter__(self) -> "ConsoleReporter":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, row: dict[str, Any]) -> None:
        acc = row.get("eval/accuracy")
        fields = {"acc": format_value(acc)} if acc is not None else {}
        self.progress.update(self.task, advance=1, **fields)


def make_console(stderr: bool = False) -> Console:
    """A console that does not squeeze tables to 80 columns when output goes to a file or a pipe."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=200)


def summary_table(summary: dict[str, Any], title: str = "result") -> Table:
    """The final figures of one run (``scope/name`` keys and the run's identity)."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if "/" in key or key in ("rounds", "algorithm", "dataset", "model", "runtime"):
            table.add_row(key, format_value(value))
    return table


def comparison_table(rows: list[dict[str, Any]], columns: list[str], title: str) -> Table:
    """One row per dict, the given columns; label columns left-aligned, figures right-aligned."""
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c in ("algorithm", "method", "setting", "model.name", "note") else "right")
    for row in rows:
        table.add_row(*(format_value(row.get(c)) for c in columns))
    return table
