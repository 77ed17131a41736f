"""``fedray report --events RUN``: who was selected each round and what became of them, from the run's
``events.parquet`` (a run with a simulated system, docs/metrics.md): per round the clients settled in it by outcome,
the median t_k of those aggregated and the slowest of them (the client the round waited for)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedray.record.run_dir import EVENTS_FILE
from fedray.report.clients import run_file

OUTCOMES = ("aggregated", "straggler", "dropout_offline", "dropout_deadline", "lost")
COLUMNS = ["round", "settled", *OUTCOMES, "median t aggregated (s)", "slowest aggregated"]


def events_path(run: str | Path) -> Path:
    """``RUN/events.parquet``, or one line naming ``--events`` and the fix."""
    return run_file(run, EVENTS_FILE, "--events", "it ran without a simulated system (set system.devices, "
                    "docs/system.md) or with a fedray that did not record events")


def event_rows(path: Path) -> list[dict[str, Any]]:
    """One row per round: the clients settled in it, their count per outcome, the median t_k of the aggregated
    ones and the slowest of them (``client: t_k``)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["round", "client", "t_s", "outcome"])
    rounds, clients = table.column("round").to_numpy(), table.column("client").to_numpy()
    t, outcome = table.column("t_s").to_numpy(zero_copy_only=False), np.asarray(table.column("outcome").to_pylist())
    rows = []
    for r in np.unique(rounds):
        mine = rounds == r
        row: dict[str, Any] = {"round": int(r), "settled": int(mine.sum())}
        row.update({o: int((mine & (outcome == o)).sum()) for o in OUTCOMES})
        arrived = np.flatnonzero(mine & (outcome == "aggregated"))
        if arrived.size:
            slowest = arrived[np.argmax(t[arrived])]
            row["median t aggregated (s)"] = f"{np.median(t[arrived]):.2f}"
            row["slowest aggregated"] = f"{clients[slowest]}: {t[slowest]:.2f} s"
        rows.append(row)
    return rows


__all__ = ["COLUMNS", "OUTCOMES", "event_rows", "events_path"]
