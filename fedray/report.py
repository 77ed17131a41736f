"""``fedray report``: compare finished runs in the papers' table form, and plot their learning curves.

Runs come from ``fedray run`` output directories (``summary.json`` marks a finished run, with
``history.parquet`` and ``config.yaml`` beside it) or from an MLflow experiment (params = the flattened
config, metrics = every history key at ``step=round``, tag ``fedray.kind`` = ``run`` / ``trial``; ``sweep``
parents are skipped). Both become :class:`RunRecord`; everything after loading is source-agnostic.

The table has one row per (method, setting), aggregated over seeds, as in DaFKD Table 1 and FedKF
Tables V-VIII:

- ``accuracy``: top-1 of the global model on the dataset's test split, in % (DaFKD Table 1).
- ``AMP`` / ``WLP``: FedKF Def. 1 / Def. 3 on the clients' local test splits, in %.
- ``FM``: FedKF Def. 2, the population variance of per-client accuracy, in fraction^2 units scaled by
  10^3, i.e. printed as "FM (x10^-3)". This is what FedKF prints: its Table II example gives FM = 0.00667
  for accuracies 0.6 / 0.7 / 0.8 (fraction^2), and Tables V-VII head the column "FM (x10^-3)" (or
  x10^-2) with values such as 7.972 for FedAvg on EMNIST alpha=0.1, i.e. 0.007972 fraction^2 (a spread of
  about 9 accuracy points, consistent with its AMP 75.61 % and WLP 57.07 %). It is *not* %^2 (that
  would be 79.72 for the same number).
- ``rounds to X%``: the first round whose global accuracy reaches the target (DaFKD Table 2, FedKF
  Table VIII), mean over the seeds that reach it.
- ``MB up`` / ``MB down``: total bytes sent over the run (FedCD Table III), 1 MB = 10^6 bytes, mean
  over seeds.

Every figure is ``mean ± std`` over seeds, std being the sample std (ddof=1), 0 for a single seed.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from fedray.errors import UserError
from fedray.tracking import resolve_tracking_uri

DEFAULT_BY_METHOD: tuple[str, ...] = ("algorithm.name",)
DEFAULT_BY_SETTING: tuple[str, ...] = ("data.dataset", "data.alpha")

# (history/summary key, column header, scale applied to the fraction, decimals)
METRIC_COLUMNS: tuple[tuple[str, str, float, int], ...] = (
    ("eval/accuracy", "accuracy (%)", 100.0, 2),
    ("eval/amp", "AMP (%)", 100.0, 2),
    ("eval/fm", "FM (×10⁻³)", 1e3, 3),
    ("eval/wlp", "WLP (%)", 100.0, 2),
)
COMM_COLUMNS: tuple[tuple[str, str], ...] = (("comm/bytes_up", "MB up"), ("comm/bytes_down", "MB down"))
EVAL_KEYS = tuple(k for k, *_ in METRIC_COLUMNS)
DASH = "—"

# Config keys that may differ between runs pooled in one row without changing what is compared.
_POOL_IGNORED_KEYS = {"seed", "name", "data.data_dir", "data.download", "federation.eval_batch_size"}
_POOL_IGNORED_PREFIXES = ("runtime.", "tracking.")
# Short labels for well-known keys (others print their last dotted part).
_LABELS = {"data.alpha": "α"}


@dataclass
class RunRecord:
    """One finished run, from a run directory or from MLflow."""

    name: str  # run dir name or MLflow run name / id
    params: dict[str, Any]  # flattened config, values typed (float/int/bool/str/None)
    history: list[dict] = field(default_factory=list)  # per-round rows: round, eval/*, comm/*, ...
    summary: dict[str, Any] = field(default_factory=dict)  # final figures as in summary.json


def _warn(message: str) -> None:
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


def _num(v: Any) -> float | None:
    """A finite-or-inf float, or None for missing / NaN / non-numeric values."""
    if isinstance(v, bool) or _missing(v):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _fmt_value(v: Any) -> str:
    if v is None:
        return DASH
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _canon(v: Any) -> Any:
    """A comparable form: 1 and 1.0 are the same value, a string "1" is not."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return ("num", float(v))
    return (type(v).__name__, repr(v))


def _sort_key(v: Any) -> tuple:
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


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _fill_algorithm_defaults(params: dict[str, Any]) -> dict[str, Any]:
    """Add the registered algorithm's default parameters that the config left implicit.

    A config stores only the ``algorithm.*`` keys it was given, so ``fedprox`` with the default mu and
    ``fedprox algorithm.mu=0.01`` would otherwise look different. Unknown algorithms are left as they are.
    """
    name = params.get("algorithm.name")
    if not isinstance(name, str):
        return params
    try:
        from fedray.algorithms import ALGORITHMS

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


def _is_run_dir(path: Path) -> bool:
    return (path / "summary.json").is_file()


def _looks_like_unfinished_run(path: Path) -> bool:
    return (path / "config.yaml").is_file() or (path / "history.parquet").is_file()


def _find_run_dirs(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        if _is_run_dir(here):
            found.append(here)
            dirnames[:] = []  # a run dir's subfolders are not runs
            continue
        if _looks_like_unfinished_run(here):
            _warn(f"skipping {here}: no summary.json (an unfinished or failed run)")
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    return found


def _read_run_dir(path: Path) -> RunRecord:
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError("RUNS", f"cannot read {path / 'summary.json'} ({e}); remove or repair that run") from None
    cfg_path = path / "config.yaml"
    if cfg_path.is_file():
        raw = yaml.safe_load(cfg_path.read_text()) or {}
        params = _flatten(raw) if isinstance(raw, dict) else {}
    else:
        _warn(f"{path}: no config.yaml; taking algorithm, dataset and seed from summary.json")
        params = {}
    for key, skey in (("algorithm.name", "algorithm"), ("data.dataset", "dataset"), ("seed", "seed")):
        if key not in params and skey in summary:
            params[key] = summary[skey]
    hist_path = path / "history.parquet"
    history: list[dict] = []
    if hist_path.is_file():
        import pyarrow.parquet as pq

        history = pq.read_table(hist_path).to_pylist()
    else:
        _warn(f"{path}: no history.parquet; rounds to target and curves are unavailable for it")
    return RunRecord(name=path.name, params=_fill_algorithm_defaults(params), history=history, summary=summary)


def load_run_dirs(paths: Iterable[str | Path]) -> list[RunRecord]:
    """Runs from ``fedray run`` output directories; each path is a run dir or a folder holding run dirs
    (searched recursively). Folders without ``summary.json`` are unfinished runs: skipped with a warning."""
    runs: list[RunRecord] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise UserError(
                "RUNS", f"{path} does not exist; give run directories (holding summary.json) or folders containing them"
            )
        if path.is_file():
            if path.name != "summary.json":
                raise UserError(
                    "RUNS", f"{path} is a file; give a run directory (holding summary.json) or a folder of them"
                )
            path = path.parent
        dirs = _find_run_dirs(path)
        if not dirs:
            _warn(f"no finished run (summary.json) under {path}")
        runs += [_read_run_dir(d) for d in dirs]
    return runs


# --------------------------------------------------------------------------------------------------
# loading: MLflow


def _sqlite_path(uri: str) -> Path | None:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :])
    return None


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
    if evaluated:
        summary.update({k: v for k, v in evaluated[-1].items() if k.startswith("eval/")})
        summary["eval/best_accuracy"] = max(row["eval/accuracy"] for row in evaluated)
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
        params=_fill_algorithm_defaults(params),
        history=history,
        summary=summary,
    )


def load_mlflow_runs(experiment: str, tracking_uri: str | None = None) -> list[RunRecord]:
    """The finished fedray runs and Tune trials of an MLflow experiment (``fedray.kind`` = run / trial).

    Sweep parents are skipped; so are runs that did not finish (RUNNING, FAILED, KILLED), with a warning.
    Figures come from the metric histories, so no artifact is downloaded.
    """
    uri = resolve_tracking_uri(tracking_uri)
    db = _sqlite_path(uri)
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
                    _warn(f"skipping MLflow run {label}: not a fedray run (no fedray.kind tag)")
                    continue
            if run.info.status != "FINISHED":
                _warn(f"skipping MLflow run {label}: status {run.info.status}, not a finished run")
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


# --------------------------------------------------------------------------------------------------
# grouping


def _label(key: str, value: Any) -> str:
    if key in ("algorithm.name", "data.dataset"):
        return _fmt_value(value)
    short = _LABELS.get(key, key.rsplit(".", 1)[-1])
    return f"{short}={_fmt_value(value)}"


def _varying_algorithm_params(runs: Sequence[RunRecord], by_method: Sequence[str]) -> dict[Any, list[str]]:
    """Per algorithm name: the ``algorithm.*`` keys whose values differ between its runs."""
    by_algo: dict[Any, list[RunRecord]] = defaultdict(list)
    for run in runs:
        by_algo[run.params.get("algorithm.name")].append(run)
    out: dict[Any, list[str]] = {}
    for algo, group in by_algo.items():
        keys = {k for r in group for k in r.params if k.startswith("algorithm.")}
        keys = sorted(keys - {"algorithm.name"} - set(by_method))
        out[algo] = [k for k in keys if len({_canon(r.params.get(k)) for r in group}) > 1]
    return out


@dataclass
class _Group:
    method_values: tuple
    method_label: str
    setting_values: tuple
    setting_label: str
    runs: list[RunRecord] = field(default_factory=list)


def group_runs(
    runs: Sequence[RunRecord],
    by_method: Sequence[str] = DEFAULT_BY_METHOD,
    by_setting: Sequence[str] = DEFAULT_BY_SETTING,
) -> list[_Group]:
    """Runs grouped by (setting, method), sorted by setting then method; warns about odd pools."""
    varying = _varying_algorithm_params(runs, by_method)
    groups: dict[tuple, _Group] = {}
    for run in runs:
        extra = varying.get(run.params.get("algorithm.name"), [])
        mkeys = [*by_method, *extra]
        mvals = tuple(run.params.get(k) for k in mkeys)
        svals = tuple(run.params.get(k) for k in by_setting)
        key = (tuple(mkeys), mvals, svals)
        if key not in groups:
            groups[key] = _Group(
                method_values=mvals,
                method_label=" ".join(_label(k, v) for k, v in zip(mkeys, mvals)) or "all",
                setting_values=svals,
                setting_label=" ".join(_label(k, v) for k, v in zip(by_setting, svals)) or "all",
            )
        groups[key].runs.append(run)
    ordered = sorted(
        groups.values(),
        key=lambda g: (
            [_sort_key(v) for v in g.setting_values],
            g.setting_label,
            [_sort_key(v) for v in g.method_values],
            g.method_label,
        ),
    )
    for g in ordered:
        _check_pool(g, by_method, by_setting)
    return ordered


def _check_pool(g: _Group, by_method: Sequence[str], by_setting: Sequence[str]) -> None:
    """Warn when a row pools runs that differ in more than their seed, or repeats a seed."""
    if len(g.runs) < 2:
        return
    grouped = set(by_method) | set(by_setting)
    keys = {k for r in g.runs for k in r.params}
    differ = sorted(
        k
        for k in keys - grouped - _POOL_IGNORED_KEYS
        if not k.startswith(_POOL_IGNORED_PREFIXES) and len({_canon(r.params.get(k)) for r in g.runs}) > 1
    )
    where = f"{g.method_label} / {g.setting_label}"
    if differ:
        shown = ", ".join(differ[:6]) + (" ..." if len(differ) > 6 else "")
        _warn(f"row '{where}' pools runs that differ in {shown}; "
              "add those keys to the method or setting keys to split them")
    seeds = [r.params.get("seed") for r in g.runs]
    dups = sorted({_fmt_value(s) for s in seeds if seeds.count(s) > 1})
    if dups:
        _warn(f"row '{where}' has several runs with seed {', '.join(dups)} (the same run loaded twice?)")


# --------------------------------------------------------------------------------------------------
# the table


def _normalise_target(target: float | None) -> float | None:
    """Target accuracy as a fraction; a value above 1 is read as a percentage (60 -> 0.6)."""
    if target is None:
        return None
    return target / 100.0 if target > 1 else float(target)


def target_column(target: float) -> str:
    return f"rounds to {_normalise_target(target) * 100:g}%"


def rounds_to_target(history: Sequence[dict], target: float, key: str = "eval/accuracy") -> int | None:
    """The first round whose ``key`` reaches ``target`` (rounds without evaluation skipped); None if never."""
    for row in sorted(history, key=lambda r: r.get("round", 0)):
        v = _num(row.get(key))
        if v is not None and v >= target:
            return int(row["round"])
    return None


def _final(run: RunRecord, key: str) -> float | None:
    """A final figure: from the summary, else the last evaluated history row (or the total for comm)."""
    v = _num(run.summary.get(key))
    if v is not None:
        return v
    if key.startswith("comm/"):
        vals = [_num(row.get(key)) for row in run.history]
        vals = [x for x in vals if x is not None]
        return float(sum(vals)) if vals else None
    for row in sorted(run.history, key=lambda r: r.get("round", 0), reverse=True):
        v = _num(row.get(key))
        if v is not None:
            return v
    return None


def _fmt_mean_std(values: Sequence[float], scale: float, decimals: int) -> str:
    if not values:
        return DASH
    mean, std = mean_std([v * scale for v in values])
    return f"{mean:.{decimals}f} ± {std:.{decimals}f}"


def _fmt_rounds(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _fmt_reached(reached: Sequence[int | None]) -> str:
    hits = [r for r in reached if r is not None]
    n = len(reached)
    if not hits:
        return DASH if n == 1 else f"{DASH} (0/{n} reached)"
    text = _fmt_rounds(sum(hits) / len(hits))
    return text if len(hits) == n else f"{text} ({len(hits)}/{n} reached)"


def build_table(
    runs: Sequence[RunRecord],
    by_method: Sequence[str] = DEFAULT_BY_METHOD,
    by_setting: Sequence[str] = DEFAULT_BY_SETTING,
    target: float | None = None,
) -> list[dict]:
    """One row per (method, setting), sorted by setting then method.

    Each row maps the column headers (``method``, ``setting``, ``seeds``, ``accuracy (%)``, ``AMP (%)``,
    ``FM (×10⁻³)``, ``WLP (%)``, ``rounds to X%`` when ``target`` is given, ``MB up``, ``MB down``) to
    display strings; ``_stats`` holds the raw per-seed numbers behind them (fractions and bytes) and
    ``_runs`` the run names.
    """
    if not runs:
        raise UserError("RUNS", "no finished runs to compare; give run directories or an MLflow experiment")
    tgt = _normalise_target(target)
    rows: list[dict] = []
    for g in group_runs(runs, by_method, by_setting):
        row: dict[str, Any] = {"method": g.method_label, "setting": g.setting_label, "seeds": str(len(g.runs))}
        stats: dict[str, Any] = {"seeds": [r.params.get("seed") for r in g.runs]}
        for key, header, scale, decimals in METRIC_COLUMNS:
            vals = [v for v in (_final(r, key) for r in g.runs) if v is not None]
            row[header] = _fmt_mean_std(vals, scale, decimals)
            stats[key] = vals
        if tgt is not None:
            reached = [rounds_to_target(r.history, tgt) for r in g.runs]
            row[target_column(tgt)] = _fmt_reached(reached)
            stats["rounds_to_target"] = reached
        for key, header in COMM_COLUMNS:
            vals = [v for v in (_final(r, key) for r in g.runs) if v is not None]
            row[header] = f"{sum(vals) / len(vals) / 1e6:,.2f}" if vals else DASH
            stats[key] = vals
        row["_stats"] = stats
        row["_runs"] = [r.name for r in g.runs]
        rows.append(row)
    return rows


def footnote(rows: Sequence[dict]) -> str:
    cols = _columns(rows)
    parts = [
        "mean ± sample std (ddof=1) over seeds; std is 0 for a single seed. accuracy: global model, top-1 on "
        "the test split; AMP / FM / WLP: FedKF Def. 1-3 on the clients' test splits; FM is the population "
        "variance of client accuracy in fraction² ×10⁻³, as FedKF Tables V-VII print it."
    ]
    if any(c.startswith("rounds to ") for c in cols):
        parts.append(
            "rounds to target: first evaluated round with accuracy ≥ target, mean over the seeds that reach it."
        )
    parts.append("MB: total bytes sent over the run (10⁶ bytes), mean over seeds.")
    return " ".join(parts)


def _columns(rows: Sequence[dict]) -> list[str]:
    return [c for c in rows[0] if not c.startswith("_")] if rows else []


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(rows: Sequence[dict]) -> str:
    """A GitHub-flavoured markdown table (header, separator, one line per row) and a footnote below."""
    if not rows:
        return "_no runs_\n"
    cols = _columns(rows)
    lines = ["| " + " | ".join(_cell(c) for c in cols) + " |"]
    lines.append("| " + " | ".join(":---" if c in ("method", "setting") else "---:" for c in cols) + " |")
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n\n" + footnote(rows) + "\n"


# --------------------------------------------------------------------------------------------------
# learning curves


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
            v = _num(row.get(metric))
            if v is not None and row.get("round") is not None:
                per_round[int(row["round"])].append(v)
    rounds = sorted(per_round)
    stats = [mean_std(per_round[r]) for r in rounds]
    return rounds, [m for m, _ in stats], [s for _, s in stats]


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
    settings: dict[str, list[_Group]] = {}
    for g in groups:
        settings.setdefault(g.setting_label, []).append(g)
    if not any(mean_curve(g.runs, metric)[0] for g in groups):
        raise UserError(
            "--plot", f"no run recorded '{metric}' per round (history.parquet / MLflow metrics); nothing to plot"
        )
    methods = list(dict.fromkeys(g.method_label for g in groups))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    scale, unit = _metric_scale(metric)

    n = len(settings)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.6 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    for i, (setting, sgroups) in enumerate(settings.items()):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        for g in sgroups:
            rounds, mean, std = mean_curve(g.runs, metric)
            if not rounds:
                continue
            m = [x * scale for x in mean]
            lo = [(x - s) * scale for x, s in zip(mean, std)]
            hi = [(x + s) * scale for x, s in zip(mean, std)]
            color = colors[g.method_label]
            ax.plot(rounds, m, color=color, marker="o" if len(rounds) < 30 else None, markersize=3,
                    label=f"{g.method_label} (n={len(g.runs)})")
            ax.fill_between(rounds, lo, hi, color=color, alpha=0.2, linewidth=0)
        ax.set_title(setting, fontsize=10)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"{metric} {unit}".strip())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(f"{metric}: mean ± std over seeds", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lstrip(".") or "png")
    return out


# --------------------------------------------------------------------------------------------------
# entry point for the CLI


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
        runs += load_mlflow_runs(experiment, tracking_uri)
    if not runs:
        where = " and ".join(
            x for x in (", ".join(sources) if sources else "", f"experiment '{experiment}'" if experiment else "") if x
        )
        raise UserError("RUNS", f"no finished runs found in {where}; a finished run directory holds summary.json")
    rows = build_table(runs, by_method, by_setting, target)
    text = to_markdown(rows)
    if out:
        out_path = Path(out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text)
    if plot:
        plot_curves(runs, plot, by_method, by_setting)
    return text
