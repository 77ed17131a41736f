"""Finished runs as :class:`RunRecord`, from ``fedray run`` output directories or an MLflow experiment.

A directory is a finished run when it holds ``summary.json`` (with ``history.parquet`` and ``config.yaml``
beside it); the file names and their readers are :mod:`fedray.record.run_dir`'s. In MLflow, params are the flattened config and metrics every history key at ``step=round``;
``sweep`` parents are skipped. Everything after loading is source-agnostic.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from fedray.errors import UserError
from fedray.overrides import flatten
from fedray.record.run_dir import (
    CONFIG_FILE,
    EVAL_KEYS,
    HISTORY_FILE,
    MLFLOW_RUN_FILE,
    SUMMARY_FILE,
    final_figures,
    is_finished,
    read_history,
    read_summary,
)
from fedray.record.tracking import resolve_tracking_uri, sqlite_path

DASH = "—"


@dataclass
class RunRecord:
    """One finished run, from a run directory or from MLflow."""

    name: str  # run dir name or MLflow run name / id
    params: dict[str, Any]  # flattened config, values typed (float/int/bool/str/None)
    history: list[dict] = field(default_factory=list)  # per-round rows: round, eval/*, comm/*, ...
    summary: dict[str, Any] = field(default_factory=dict)  # final figures as in summary.json
    run_id: str | None = None  # its MLflow run, when it was tracked (a run dir's mlflow_run.json)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# values


_INT_RE = re.compile(r"[-+]?\d+")
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(nan|inf|infinity)", re.IGNORECASE)


def parse_value(text: Any) -> Any:
    """An MLflow param string back to its type: ``'0.1'`` -> 0.1, ``'3'`` -> 3, ``'True'`` -> True,
    ``'None'`` -> None; anything else stays a string. Non-strings pass through."""
    if not isinstance(text, str):
        return text
    s = text.strip()
    if s in ("None", "null", "~", ""):
        return None
    if s.lower() in ("true", "false"):
        return s.lower() == "true"
    if _INT_RE.fullmatch(s):
        return int(s)
    if _FLOAT_RE.fullmatch(s):
        return float(s)
    return text


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def as_number(v: Any) -> float | None:
    """A finite-or-inf float, or None for missing / NaN / non-numeric values."""
    if isinstance(v, bool) or _missing(v):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def format_cell(v: Any) -> str:
    if v is None:
        return DASH
    if isinstance(v, bool):  # as a config or an override spells it (runtime.vectorize=true)
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def canonical(v: Any) -> Any:
    """A comparable form: 1 and 1.0 are the same value, a string "1" is not."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return ("num", float(v))
    return (type(v).__name__, repr(v))


def sort_key(v: Any) -> tuple:
    if isinstance(v, bool):
        return (1, str(v))
    if isinstance(v, (int, float)):
        return (0, float(v), "")
    if v is None:
        return (2, "")
    return (1, str(v))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1); std is 0 for a single value."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    var = sum((x - mean) ** 2 for x in values) / (n - 1)
    return mean, math.sqrt(var)


def fmt_mean_std(values: Iterable[Any], scale: float = 100.0, decimals: int = 2) -> str:
    """``mean ± std`` over seeds, as every table of fedray's prints it: each value times ``scale`` first (the
    default turns fractions into %), then :func:`mean_std` of those that are numbers (None and NaN left out),
    both with ``decimals`` decimals; "—" when none is left."""
    scaled = [v * scale for v in (as_number(x) for x in values) if v is not None]
    if not scaled:
        return DASH
    mean, std = mean_std(scaled)
    return f"{mean:.{decimals}f} ± {std:.{decimals}f}"


def fill_algorithm_defaults(params: dict[str, Any]) -> dict[str, Any]:
    """Add the registered algorithm's default parameters that the config left implicit.

    A config stores only the ``algorithm.*`` keys it was given, so ``fedprox`` with the default mu and
    ``fedprox algorithm.mu=0.01`` would otherwise look different. Unknown algorithms are left as they are.
    """
    name = params.get("algorithm.name")
    if not isinstance(name, str):
        return params
    try:
        from fedray.methods import ALGORITHMS

        cls = ALGORITHMS.get(name)
        fields = cls.Params.model_fields if cls is not None else {}
    except Exception:  # a broken import must not stop a report
        return params
    for key, info in fields.items():
        dotted = f"algorithm.{key}"
        if dotted not in params and not info.is_required():
            default = info.get_default(call_default_factory=True)
            if isinstance(default, (int, float, str, bool)) or default is None:
                params[dotted] = default
    return params


# --------------------------------------------------------------------------------------------------
# loading: run directories


def _looks_like_unfinished_run(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() or (path / HISTORY_FILE).is_file()


def _find_run_dirs(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        if is_finished(here):
            found.append(here)
            dirnames[:] = []  # a run dir's subfolders are not runs
            continue
        if _looks_like_unfinished_run(here):
            warn(f"skipping {here}: no {SUMMARY_FILE} (an unfinished or failed run)")
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    return found


def _read_run_dir(path: Path) -> RunRecord:
    try:
        summary = read_summary(path)
    except (OSError, ValueError) as e:
        raise UserError("RUNS", f"cannot read {path / SUMMARY_FILE} ({e}); remove or repair that run") from None
    cfg_path = path / CONFIG_FILE
    if cfg_path.is_file():
        raw = yaml.safe_load(cfg_path.read_text()) or {}
        params = flatten(raw) if isinstance(raw, dict) else {}
    else:
        warn(f"{path}: no {CONFIG_FILE}; taking algorithm, dataset and seed from {SUMMARY_FILE}")
        params = {}
    for key, skey in (("algorithm.name", "algorithm"), ("data.dataset", "dataset"), ("seed", "seed")):
        if key not in params and skey in summary:
            params[key] = summary[skey]
    hist_path = path / HISTORY_FILE
    history: list[dict] = []
    if hist_path.is_file():
        history = read_history(hist_path)
    else:
        warn(f"{path}: no {HISTORY_FILE}; rounds to target and curves are unavailable for it")
    run_id = None
    try:  # a tracked run names its MLflow run, so that --experiment does not count it a second time
        run_id = json.loads((path / MLFLOW_RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        pass
    return RunRecord(name=path.name, params=fill_algorithm_defaults(params), history=history, summary=summary,
                     run_id=run_id)


def load_run_dirs(paths: Iterable[str | Path]) -> list[RunRecord]:
    """Runs from ``fedray run`` output directories; each path is a run dir or a folder holding run dirs
    (searched recursively). Folders without ``summary.json`` are unfinished runs: skipped with a warning.
    A run dir reached twice (``runs runs/a``) is read once: counted twice, it would pass for two seeds."""
    runs: list[RunRecord] = []
    seen: set[Path] = set()
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise UserError(
                "RUNS", f"{path} does not exist; give run directories (holding {SUMMARY_FILE}) or folders containing them"
            )
        if path.is_file():
            if path.name != SUMMARY_FILE:
                raise UserError(
                    "RUNS", f"{path} is a file; give a run directory (holding {SUMMARY_FILE}) or a folder of them"
                )
            path = path.parent
        dirs = _find_run_dirs(path)
        if not dirs:
            warn(f"no finished run ({SUMMARY_FILE}) under {path}")
        for d in dirs:
            if (real := d.resolve()) not in seen:
                seen.add(real)
                runs.append(_read_run_dir(d))
    return runs


# --------------------------------------------------------------------------------------------------
# loading: MLflow


def _mlflow_record(client: Any, run: Any) -> RunRecord:
    params = {k: parse_value(v) for k, v in run.data.params.items()}
    tags = run.data.tags
    if "algorithm.name" not in params and tags.get("fedray.algorithm"):
        params["algorithm.name"] = tags["fedray.algorithm"]
    if "data.dataset" not in params and tags.get("fedray.dataset"):
        params["data.dataset"] = tags["fedray.dataset"]

    # Full per-step histories (the run's "latest" metrics are only the last value). A step logged twice
    # (a retried round) keeps its latest value.
    rows: dict[int, dict[str, Any]] = {}
    keys = sorted(run.data.metrics)
    for key in keys:
        points = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
        for m in points:
            rows.setdefault(int(m.step), {"round": int(m.step)})[key] = float(m.value)
    all_keys = list(dict.fromkeys([*keys, *EVAL_KEYS]))
    history = [{"round": r, **{k: rows[r].get(k) for k in all_keys}} for r in sorted(rows)]

    evaluated = [row for row in history if not _missing(row.get("eval/accuracy"))]
    summary: dict[str, Any] = {
        "name": run.info.run_name or run.info.run_id,
        "run_id": run.info.run_id,
        "algorithm": params.get("algorithm.name"),
        "dataset": params.get("data.dataset"),
        "seed": params.get("seed"),
        "rounds": len(history),
    }
    summary.update(final_figures(evaluated))
    for key in ("comm/bytes_up", "comm/bytes_down"):
        vals = [row[key] for row in history if not _missing(row.get(key))]
        if vals:
            summary[key] = float(sum(vals))
    times = [row["time/round_s"] for row in history if not _missing(row.get("time/round_s"))]
    if times:
        summary["time/round_s"] = sum(times) / len(times)
    if run.info.end_time and run.info.start_time:
        summary["time/total_s"] = (run.info.end_time - run.info.start_time) / 1000.0
    return RunRecord(
        name=run.info.run_name or run.info.run_id,
        params=fill_algorithm_defaults(params),
        history=history,
        summary=summary,
        run_id=run.info.run_id,
    )


def load_mlflow_runs(experiment: str, tracking_uri: str | None = None) -> list[RunRecord]:
    """The finished fedray runs and Tune trials of an MLflow experiment (``fedray.kind`` = run / trial).

    Sweep parents are skipped; so are runs that did not finish (RUNNING, FAILED, KILLED), with a warning.
    Figures come from the metric histories, so no artifact is downloaded.
    """
    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        # Opening a missing SQLite store would silently create an empty one.
        raise UserError(
            "--experiment",
            f"no MLflow store at {db}; run from the folder holding mlflow.db, or point MLFLOW_TRACKING_URI "
            f"(or the tracking URI option) at the store the runs were tracked in",
        )
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None or exp.lifecycle_stage != "active":
            names = sorted(e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY))
            raise UserError(
                "--experiment",
                f"no experiment '{experiment}' in {uri}; experiments there: {', '.join(names) or 'none'}",
            )
        runs: list[Any] = []
        token = None
        while True:
            page = client.search_runs(
                [exp.experiment_id], run_view_type=ViewType.ACTIVE_ONLY, max_results=1000, page_token=token,
                order_by=["attributes.start_time ASC"],
            )
            runs += list(page)
            token = page.token
            if not token:
                break
        records = []
        for run in runs:
            kind = run.data.tags.get("fedray.kind")
            label = run.info.run_name or run.info.run_id
            if kind == "sweep":
                continue
            if kind not in ("run", "trial"):
                if "algorithm.name" not in run.data.params:
                    warn(f"skipping MLflow run {label}: not a fedray run (no fedray.kind tag)")
                    continue
            if run.info.status != "FINISHED":
                warn(f"skipping MLflow run {label}: status {run.info.status}, not a finished run")
                continue
            records.append(_mlflow_record(client, run))
    except UserError:
        raise
    except Exception as e:  # an unreachable server or a malformed URI is the user's to fix
        first = (str(e).splitlines() or [""])[0][:200]
        raise UserError(
            "--experiment", f"cannot read MLflow store {uri} ({type(e).__name__}: {first}); check the tracking URI"
        ) from None
    return records

