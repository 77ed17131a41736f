"""What the method-comparison benchmarks share: a grid of runs (method x setting x seed) run in separate
processes, resumable, and mean ± std cells for their tables."""

from __future__ import annotations

import argparse
import math
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

LAST_N = 5  # the tables' "last 5": mean of the last 5 evaluations (one round's accuracy swings a lot)


def mean_std(vals: Sequence[float | None], scale: float = 100.0) -> str:
    """``mean ± sample std`` of the finite values, scaled (fractions -> %); "—" when there are none."""
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    if not vals:
        return "—"
    m = float(np.mean(vals)) * scale
    s = float(np.std(vals, ddof=1)) * scale if len(vals) > 1 else 0.0
    return f"{m:.2f} ± {s:.2f}"


def grid_args(ap: argparse.ArgumentParser, methods: Sequence[str], settings: Sequence[str], rounds: int,
              runs_dir: str) -> None:
    """The options every grid benchmark takes."""
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", default=list(settings), choices=list(settings))
    ap.add_argument("--methods", nargs="+", default=list(methods), choices=list(methods))
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--runs-dir", default=runs_dir)
    ap.add_argument("--report-only", action="store_true", help="only tabulate the finished runs")


def resume_point(out: Path) -> Path | None:
    """``out`` when it holds a checkpoint of an unfinished run: a stopped benchmark goes on from there, with
    the figures of an uninterrupted run (``run_experiment(..., resume_from=...)``)."""
    from fedray.report.checkpoint import FILENAME

    return out if (out / FILENAME).is_file() else None


def run_grid(run_one: Callable[[dict], str], jobs: list[dict], workers: int) -> None:
    """``run_one(job)`` for every job in ``workers`` spawned processes, printing each result as it ends."""
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        for fut in as_completed([pool.submit(run_one, j) for j in jobs]):
            print(fut.result(), flush=True)
