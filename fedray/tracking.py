"""Console progress (a rich progress bar per run, a final table) and result files.

MLflow tracking builds on the same per-round rows (``scope/name`` keys).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

EVAL_KEYS = ("eval/accuracy", "eval/amp", "eval/fm", "eval/wlp")


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


class ConsoleReporter:
    """A progress bar advanced once per round, showing the latest accuracy."""

    def __init__(self, total_rounds: int, title: str, enabled: bool = True, console: Console | None = None):
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
        self.task = self.progress.add_task(title, total=total_rounds, acc="-")

    def __enter__(self) -> "ConsoleReporter":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, row: dict[str, Any]) -> None:
        acc = row.get("eval/accuracy")
        fields = {"acc": _fmt(acc)} if acc is not None else {}
        self.progress.update(self.task, advance=1, **fields)


def make_console(stderr: bool = False) -> Console:
    """A console that does not squeeze tables to 80 columns when output goes to a file or a pipe."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=200)


def summary_table(summary: dict[str, Any], title: str = "result") -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if "/" in key or key in ("rounds", "algorithm", "dataset", "model", "runtime"):
            table.add_row(key, _fmt(value))
    return table


def comparison_table(rows: list[dict[str, Any]], columns: list[str], title: str) -> Table:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c in ("algorithm", "method", "setting") else "right")
    for row in rows:
        table.add_row(*(_fmt(row.get(c)) for c in columns))
    return table


# --------------------------------------------------------------------------------------------------
# result files: written to a temporary name and renamed, so a crash never leaves a half file


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, allow_nan=True) + "\n").encode())


def write_history(path: Path, history: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for row in history:
        keys += [k for k in row if k not in keys]
    for k in EVAL_KEYS:  # eval columns exist even when a run evaluated rarely
        if k not in keys:
            keys.append(k)
    columns = {k: [row.get(k) for row in history] for k in keys}
    table = pa.table({k: pa.array(v, type=pa.int64() if k == "round" else None) for k, v in columns.items()})
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_history(path: str | Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()
