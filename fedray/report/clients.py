"""``fedray report --clients RUN``: which client falls behind, and when, from the run's ``clients.parquet``.

Per evaluated round, over the evaluated clients (those with a local test split), with acc_k as in
:mod:`fedray.evaluation`:

- the spread of acc_k: worst, lower quartile, median, upper quartile, best, and which client is worst;
- FedKF's WLP = min_k acc_k (Def. 3), FM = the population variance of acc_k (Def. 2) and
  AMP = total correct / total test samples (Def. 1): the run's ``eval/wlp``, ``eval/fm`` and ``eval/amp``
  recomputed from its rows.

The file is read a record batch at a time and summarised round by round (it is written in round order), so
100,000 clients over many rounds cost one round's rows in memory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from fedray.errors import ConfigError
from fedray.record.checkpoint import FILENAME as CHECKPOINT_FILE
from fedray.record.run_dir import CLIENT_HISTORY_FILE, SUMMARY_FILE, read_summary

#: At most this many rounds in the printed table: every one up to it, else evenly spaced, first and last kept.
TABLE_ROUNDS = 12
BATCH_ROWS = 1 << 16  # rows read at a time
_COLUMNS = ["round", "client", "accuracy", "correct", "samples"]


@dataclass
class RoundSpread:
    """One evaluated round's per-client accuracies, summarised."""

    round: int
    clients: int
    worst: float  # = WLP
    worst_client: int  # the lowest id among equally worst clients
    q25: float
    median: float
    q75: float
    best: float
    best_client: int
    fm: float
    amp: float


def client_history_path(run: str | Path) -> Path:
    """``RUN/clients.parquet``, or one line naming ``--clients`` and the fix when ``run`` has none."""
    return run_file(run, CLIENT_HISTORY_FILE, "--clients", "the run was made by a fedray that did not record "
                    "per-client history (or resumed from such a checkpoint); run it again to record it")


def run_file(run: str | Path, name: str, flag: str, why_missing: str) -> Path:
    """``RUN/name`` of a finished run, or one line naming ``flag`` and the fix: ``why_missing`` when the run
    finished without it, ``--resume`` when it has not finished (the file is written at the end)."""
    run = Path(run)
    path = run / name
    if path.is_file():
        return path
    if not run.exists():
        raise ConfigError(flag, f"{run} does not exist; give the directory of a finished fedray run")
    if not run.is_dir():
        raise ConfigError(flag, f"{run} is not a directory; give the run's directory (it holds {name}), not a file")
    if (run / SUMMARY_FILE).is_file():
        raise ConfigError(flag, f"{run} has no {name}: {why_missing}")
    if (run / CHECKPOINT_FILE).is_file():
        raise ConfigError(flag, f"{run} has not finished ({name} is written at the end); finish it with: "
                          f"fedray run --resume {run}")
    raise ConfigError(flag, f"{run} holds no finished fedray run (no {SUMMARY_FILE}); give the directory of a "
                      "finished run")


def _rounds(path: Path) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(round, its rows as arrays) in file order, a record batch at a time."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    missing = [c for c in _COLUMNS if c not in file.schema_arrow.names]
    if missing:
        raise ConfigError("--clients", f"{path} lacks column(s) {', '.join(missing)}; it is not a fedray "
                          f"{CLIENT_HISTORY_FILE}")
    held: dict[str, list[np.ndarray]] = {c: [] for c in _COLUMNS}
    current, seen = None, set()
    for batch in file.iter_batches(columns=_COLUMNS, batch_size=BATCH_ROWS):
        cols = {c: batch.column(c).to_numpy(zero_copy_only=False) for c in _COLUMNS}
        rounds = cols["round"]
        cuts = [0, *(np.flatnonzero(np.diff(rounds)) + 1), len(rounds)]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            r = int(rounds[lo])
            if r != current:
                if current is not None:
                    yield current, {c: np.concatenate(v) for c, v in held.items()}
                    held = {c: [] for c in _COLUMNS}
                if r in seen:
                    raise ConfigError("--clients", f"{path}: the rows of round {r} are not together; a fedray "
                                      f"{CLIENT_HISTORY_FILE} is written round by round")
                current = r
                seen.add(r)
            for c in _COLUMNS:
                held[c].append(cols[c][lo:hi])
    if current is not None:
        yield current, {c: np.concatenate(v) for c, v in held.items()}


def spread(round_: int, rows: dict[str, np.ndarray]) -> RoundSpread:
    acc = rows["accuracy"].astype(np.float64)
    q25, median, q75 = np.percentile(acc, [25, 50, 75])
    worst, best = int(np.argmin(acc)), int(np.argmax(acc))  # the first of equals: rows are in client-id order
    return RoundSpread(round=round_, clients=len(acc), worst=float(acc[worst]), worst_client=int(rows["client"][worst]),
                       q25=float(q25), median=float(median), q75=float(q75), best=float(acc[best]),
                       best_client=int(rows["client"][best]), fm=float(np.var(acc)),
                       amp=float(rows["correct"].sum() / max(int(rows["samples"].sum()), 1)))


def round_spreads(path: str | Path) -> list[RoundSpread]:
    """Every evaluated round of a ``clients.parquet``, summarised (one round's rows in memory at a time)."""
    out = [spread(r, rows) for r, rows in _rounds(Path(path)) if len(rows["accuracy"])]
    if not out:
        raise ConfigError("--clients", f"{path} holds no rows; the run evaluated no client")
    return out


def shown_rounds(spreads: list[RoundSpread], most: int = TABLE_ROUNDS) -> list[RoundSpread]:
    """All rounds when there are at most ``most``, else ``most`` of them evenly spaced, first and last kept."""
    if len(spreads) <= most:
        return spreads
    picks = sorted({int(round(i)) for i in np.linspace(0, len(spreads) - 1, most)})
    return [spreads[i] for i in picks]


def table_rows(spreads: list[RoundSpread]) -> list[dict[str, Any]]:
    """The printed table: accuracies in %, FM x 10^3 (FedKF's tables' units, as ``fedray report`` prints them)."""
    return [{"round": s.round, "clients": s.clients, "WLP (%)": f"{100 * s.worst:.2f}", "worst client": s.worst_client,
             "q25 (%)": f"{100 * s.q25:.2f}", "median (%)": f"{100 * s.median:.2f}", "q75 (%)": f"{100 * s.q75:.2f}",
             "best (%)": f"{100 * s.best:.2f}", "FM (×10⁻³)": f"{1e3 * s.fm:.3f}", "AMP (%)": f"{100 * s.amp:.2f}"}
            for s in spreads]


TABLE_COLUMNS = ["round", "clients", "WLP (%)", "worst client", "q25 (%)", "median (%)", "q75 (%)", "best (%)",
                 "FM (×10⁻³)", "AMP (%)"]


def most_often_worst(spreads: list[RoundSpread]) -> tuple[int, int]:
    """(client, how many evaluations it was the worst at): the lowest id among equally frequent ones."""
    counts = Counter(s.worst_client for s in spreads)
    client = min(counts, key=lambda c: (-counts[c], c))
    return client, counts[client]


def plot_client_spread(spreads: list[RoundSpread], path: str | Path, title: str = "") -> Path:
    """Accuracy across clients per evaluated round: the median, the interquartile band, the worst client
    (WLP) and the best, in %; FM (x 10^3) on the right axis. No pyplot: the Agg canvas directly."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rounds = [s.round for s in spreads]
    marker = "o" if len(rounds) < 30 else None
    fig = Figure(figsize=(7, 4.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.fill_between(rounds, [100 * s.q25 for s in spreads], [100 * s.q75 for s in spreads], color="C0", alpha=0.2,
                    linewidth=0, label="interquartile range")
    ax.plot(rounds, [100 * s.median for s in spreads], color="C0", marker=marker, markersize=3, label="median")
    ax.plot(rounds, [100 * s.best for s in spreads], color="C2", marker=marker, markersize=3, label="best client")
    ax.plot(rounds, [100 * s.worst for s in spreads], color="C3", marker=marker, markersize=3,
            label="worst client (WLP)")
    ax.set_xlabel("round")
    ax.set_ylabel("client accuracy on its test split (%)")
    ax.set_ylim(0, 100)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    fm = ax.twinx()
    fm.plot(rounds, [1e3 * s.fm for s in spreads], color="C1", linestyle="--", marker=marker, markersize=3,
            label="FM (variance, right)")
    fm.set_ylabel("FM (×10⁻³)")
    fm.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + fm.get_legend_handles_labels()[0]
    # Below the axes: inside, it would hide some curve whichever corner it took.
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15),
              ncol=3, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lstrip(".") or "png")
    return out


def run_title(run: str | Path, clients: int) -> str:
    """"NAME: METHOD on DATASET, N clients evaluated" from the run's summary.json (its folder's name without one)."""
    try:
        s = read_summary(run)
        return f"{s['name']}: {s['algorithm']} on {s['dataset']}, {clients} clients evaluated"
    except (OSError, ValueError, KeyError):
        return f"{Path(run).name}, {clients} clients evaluated"
