"""The comparison table of ``fedray report`` (its learning curves: :mod:`fedray.report.curves`).

Runs come from ``fedray run`` output directories (``summary.json`` marks a finished run, with
``history.parquet`` and ``config.yaml`` beside it) or from an MLflow experiment (params = the flattened
config, metrics = every history key at ``step=round``, tag ``fedray.kind`` = ``run`` / ``trial``; ``sweep``
parents are skipped). Both become :class:`RunRecord`; everything after loading is source-agnostic.

The table has one row per (method, setting), aggregated over seeds, as in DaFKD Table 1 and FedKF
Tables V-VIII:

- ``accuracy``: top-1 of the global model on the dataset's test split, in % (DaFKD Table 1).
- ``last 5``: that accuracy averaged over the last 5 evaluated rounds. Under strong heterogeneity one
  round's figure swings by 10-20 points (a round's 8 sampled clients may miss whole classes); the papers
  print one number, and this column says how much of it is the luck of the last round.
- ``AMP`` / ``WLP``: FedKF Def. 1 / Def. 3 on the clients' local test splits, in %.
- ``val``: runs with a validation set (``data.val_per_class``): the global accuracy on it, in %.
- ``attack success``, ``malicious a round``, ``malicious kept a round``: runs with an adversary
  (``adversary.*``): ``eval/attack_success`` at the last round, in %; ``adv/malicious_uploads`` and
  ``adv/malicious_kept`` averaged over the rounds.
- ``ε``: runs with client-level DP (``privacy.*``): ``privacy/epsilon`` after the last round.
- ``FM``: FedKF Def. 2, the population variance of per-client accuracy, in fraction^2 units scaled by
  10^3, i.e. printed as "FM (x10^-3)". This is what FedKF prints: its Table II example gives FM = 0.00667
  for accuracies 0.6 / 0.7 / 0.8 (fraction^2), and Tables V-VII head the column "FM (x10^-3)" (or
  x10^-2) with values such as 7.972 for FedAvg on EMNIST alpha=0.1, i.e. 0.007972 fraction^2 (a spread of
  about 9 accuracy points, consistent with its AMP 75.61 % and WLP 57.07 %). It is *not* %^2 (that
  would be 79.72 for the same number).
- ``rounds to X%``: the first round whose global accuracy reaches the target (DaFKD Table 2, FedKF
  Table VIII), mean over the seeds that reach it.
- ``MB to X%``: bytes sent up and down until the round that first reaches the target (FedCD Table III's
  communication to a given accuracy), mean over the seeds that reach it.
- ``MB up`` / ``MB down``: total bytes sent over the run (FedCD Table III), 1 MB = 10^6 bytes, mean
  over seeds; ``MB setup``: one-time bytes before round 1 (FedCD's validation images to every client),
  shown when a run has them.

Every figure is ``mean ± std`` over seeds, std being the sample std (ddof=1), 0 for a single seed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from fedray.paths import DATA_SOURCE_KEYS
from fedray.errors import UserError
from fedray.evaluation import rounds_to_target as _first_round_reaching
from fedray.report.runs import DASH, RunRecord, canonical, format_cell, as_number, sort_key, warn, fmt_mean_std

DEFAULT_BY_METHOD: tuple[str, ...] = ("algorithm.name",)
DEFAULT_BY_SETTING: tuple[str, ...] = ("data.dataset", "data.alpha")

# (history/summary key, column header, scale applied to the fraction, decimals)
METRIC_COLUMNS: tuple[tuple[str, str, float, int], ...] = (
    ("eval/accuracy", "accuracy (%)", 100.0, 2),
    ("eval/amp", "AMP (%)", 100.0, 2),
    ("eval/fm", "FM (×10⁻³)", 1e3, 3),
    ("eval/wlp", "WLP (%)", 100.0, 2),
)
LAST_N = 5
LAST_N_COLUMN = f"last {LAST_N} (%)"
VAL_COLUMN = "val (%)"
ATTACK_COLUMN = "attack success (%)"
EPSILON_COLUMN = "ε"
# runs with an adversary (docs/adversaries.md): per-round figures shown as their mean over the run's rounds
ADVERSARY_COLUMNS: tuple[tuple[str, str], ...] = (("adv/malicious_uploads", "malicious a round"),
                                                   ("adv/malicious_kept", "malicious kept a round"))
COMM_COLUMNS: tuple[tuple[str, str], ...] = (("comm/bytes_up", "MB up"), ("comm/bytes_down", "MB down"))

# Config keys that may differ between runs pooled in one row without changing what is compared.
_POOL_IGNORED_KEYS = {"seed", "name", *DATA_SOURCE_KEYS, "federation.eval_batch_size"}
_POOL_IGNORED_PREFIXES = ("runtime.", "tracking.")
# Short labels for well-known keys (others print their last dotted part).
_LABELS = {"data.alpha": "α"}

def _label(key: str, value: Any) -> str:
    if key in ("algorithm.name", "data.dataset"):
        return format_cell(value)
    short = _LABELS.get(key, key.rsplit(".", 1)[-1])
    return f"{short}={format_cell(value)}"


def _varying_algorithm_params(runs: Sequence[RunRecord], by_method: Sequence[str]) -> dict[Any, list[str]]:
    """Per algorithm name: the ``algorithm.*`` keys whose values differ between its runs."""
    by_algo: dict[Any, list[RunRecord]] = defaultdict(list)
    for run in runs:
        by_algo[run.params.get("algorithm.name")].append(run)
    out: dict[Any, list[str]] = {}
    for algo, group in by_algo.items():
        keys = {k for r in group for k in r.params if k.startswith("algorithm.")}
        keys = sorted(keys - {"algorithm.name"} - set(by_method))
        out[algo] = [k for k in keys if len({canonical(r.params.get(k)) for r in group}) > 1]
    return out


@dataclass
class Group:
    method_values: tuple
    method_label: str
    setting_values: tuple
    setting_label: str
    runs: list[RunRecord] = field(default_factory=list)


def group_runs(
    runs: Sequence[RunRecord],
    by_method: Sequence[str] = DEFAULT_BY_METHOD,
    by_setting: Sequence[str] = DEFAULT_BY_SETTING,
) -> list[Group]:
    """Runs grouped by (setting, method), sorted by setting then method; warns about odd pools."""
    varying = _varying_algorithm_params(runs, by_method)
    groups: dict[tuple, Group] = {}
    for run in runs:
        extra = varying.get(run.params.get("algorithm.name"), [])
        mkeys = [*by_method, *extra]
        mvals = tuple(run.params.get(k) for k in mkeys)
        svals = tuple(run.params.get(k) for k in by_setting)
        key = (tuple(mkeys), mvals, svals)
        if key not in groups:
            groups[key] = Group(
                method_values=mvals,
                method_label=" ".join(_label(k, v) for k, v in zip(mkeys, mvals)) or "all",
                setting_values=svals,
                setting_label=" ".join(_label(k, v) for k, v in zip(by_setting, svals)) or "all",
            )
        groups[key].runs.append(run)
    ordered = sorted(
        groups.values(),
        key=lambda g: (
            [sort_key(v) for v in g.setting_values],
            g.setting_label,
            [sort_key(v) for v in g.method_values],
            g.method_label,
        ),
    )
    for g in ordered:
        _check_pool(g, by_method, by_setting)
    return ordered


def _check_pool(g: Group, by_method: Sequence[str], by_setting: Sequence[str]) -> None:
    """Warn when a row pools runs that differ in more than their seed, or repeats a seed."""
    if len(g.runs) < 2:
        return
    grouped = set(by_method) | set(by_setting)
    keys = {k for r in g.runs for k in r.params}
    differ = sorted(
        k
        for k in keys - grouped - _POOL_IGNORED_KEYS
        if not k.startswith(_POOL_IGNORED_PREFIXES) and len({canonical(r.params.get(k)) for r in g.runs}) > 1
    )
    where = f"{g.method_label} / {g.setting_label}"
    if differ:
        shown = ", ".join(differ[:6]) + (" ..." if len(differ) > 6 else "")
        warn(f"row '{where}' pools runs that differ in {shown}; "
              "add those keys to the method or setting keys to split them")
    seeds = [r.params.get("seed") for r in g.runs]
    dups = sorted({format_cell(s) for s in seeds if seeds.count(s) > 1})
    if dups:
        warn(f"row '{where}' has several runs with seed {', '.join(dups)} (the same run loaded twice?)")


# --------------------------------------------------------------------------------------------------
# the table


def _normalise_target(target: float | None) -> float | None:
    """Target accuracy as a fraction; a value above 1 is read as a percentage (60 -> 0.6)."""
    if target is None:
        return None
    return target / 100.0 if target > 1 else float(target)


def target_column(target: float) -> str:
    return f"rounds to {_normalise_target(target) * 100:g}%"


def mb_target_column(target: float) -> str:
    return f"MB to {_normalise_target(target) * 100:g}%"


def hours_target_column(target: float) -> str:
    return f"sim h to {_normalise_target(target) * 100:g}%"


def hours_text(hours: float) -> str:
    """Simulated hours to two decimals, under an hour to three significant digits (56 s and 87 s read 0.0156 and
    0.0242, not both 0.02)."""
    return f"{hours:,.2f}" if hours >= 1 else f"{hours:.3g}"


def sim_hours_at(history: Sequence[dict], round_: int | None) -> float | None:
    """The simulated clock (``sim/clock_s``, in hours) at the end of ``round_``; None without a simulated system or
    when the target was never reached."""
    if round_ is None:
        return None
    rows = [r for r in history if r.get("round") == round_]
    clock = as_number(rows[0].get("sim/clock_s")) if rows else None
    return clock / 3600.0 if clock is not None else None


def bytes_to_round(history: Sequence[dict], round_: int | None) -> float | None:
    """Bytes sent up and down in rounds 1..``round_`` (None when the target was never reached)."""
    if round_ is None:
        return None
    return float(sum((as_number(r.get("comm/bytes_up")) or 0.0) + (as_number(r.get("comm/bytes_down")) or 0.0)
                     for r in history if r["round"] <= round_))


def rounds_to_target(history: Sequence[dict], target: float, key: str = "eval/accuracy") -> int | None:
    """The first round whose ``key`` reaches ``target`` (rounds without evaluation skipped); None if never."""
    rows = sorted(history, key=lambda r: r.get("round", 0))
    return _first_round_reaching([r["round"] for r in rows], [as_number(r.get(key)) for r in rows], target)


def _round_mean(run: RunRecord, key: str) -> float | None:
    """The mean of a per-round figure over the rounds that have it (None when none has)."""
    vals = [v for v in (as_number(row.get(key)) for row in run.history) if v is not None]
    return sum(vals) / len(vals) if vals else None


def _final(run: RunRecord, key: str) -> float | None:
    """A final figure: from the summary, else the last evaluated history row (or the total for comm)."""
    v = as_number(run.summary.get(key))
    if v is not None:
        return v
    if key.startswith("comm/"):
        vals = [as_number(row.get(key)) for row in run.history]
        vals = [x for x in vals if x is not None]
        return float(sum(vals)) if vals else None
    for row in sorted(run.history, key=lambda r: r.get("round", 0), reverse=True):
        v = as_number(row.get(key))
        if v is not None:
            return v
    return None


def last_n_mean(history: Sequence[dict], key: str = "eval/accuracy", n: int = LAST_N) -> float | None:
    """Mean of ``key`` over a history's last ``n`` evaluated rounds (rounds without evaluation skipped)."""
    rows = sorted(history, key=lambda r: r.get("round", 0))
    vals = [v for v in (as_number(r.get(key)) for r in rows) if v is not None][-n:]
    return sum(vals) / len(vals) if vals else None


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

    Each row maps the column headers (``method``, ``setting``, ``seeds``, ``accuracy (%)``, ``last 5 (%)``,
    ``AMP (%)``, ``FM (×10⁻³)``, ``WLP (%)``, ``rounds to X%`` and ``MB to X%`` when ``target`` is given (and
    ``sim h to X%`` for runs with a simulated system), ``MB up``,
    ``MB down``) to display strings; ``_stats`` holds the raw per-seed numbers behind them (fractions and bytes) and
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
            row[header] = fmt_mean_std(vals, scale, decimals)
            stats[key] = vals
            if key == "eval/accuracy":
                last = [v for v in (last_n_mean(r.history) for r in g.runs) if v is not None]
                row[LAST_N_COLUMN] = fmt_mean_std(last, scale, decimals)
                stats["eval/accuracy_last_n"] = last
        val = [v for v in (_final(r, "val/accuracy") for r in g.runs) if v is not None]
        if val:  # runs with a validation set (data.val_per_class)
            row[VAL_COLUMN] = fmt_mean_std(val, 100.0, 2)
            stats["val/accuracy"] = val
        attack = [v for v in (_final(r, "eval/attack_success") for r in g.runs) if v is not None]
        if attack:  # a backdoor's runs
            row[ATTACK_COLUMN] = fmt_mean_std(attack, 100.0, 2)
            stats["eval/attack_success"] = attack
        epsilon = [v for v in (_final(r, "privacy/epsilon") for r in g.runs) if v is not None]
        if epsilon:  # private runs: epsilon after their last round
            row[EPSILON_COLUMN] = fmt_mean_std(epsilon, 1.0, 2)
            stats["privacy/epsilon"] = epsilon
        for key, header in ADVERSARY_COLUMNS:
            per_run = [v for v in (_round_mean(r, key) for r in g.runs) if v is not None]
            if per_run:
                row[header] = f"{sum(per_run) / len(per_run):.2f}"
                stats[key] = per_run
        if tgt is not None:
            reached = [rounds_to_target(r.history, tgt) for r in g.runs]
            row[target_column(tgt)] = _fmt_reached(reached)
            stats["rounds_to_target"] = reached
            to_target = [bytes_to_round(r.history, rr) for r, rr in zip(g.runs, reached)]
            hits = [b for b in to_target if b is not None]
            row[mb_target_column(tgt)] = f"{sum(hits) / len(hits) / 1e6:,.2f}" if hits else DASH
            stats["bytes_to_target"] = to_target
            if any(as_number(row.get("sim/clock_s")) is not None for r in g.runs for row in r.history):
                hours = [sim_hours_at(r.history, rr) for r, rr in zip(g.runs, reached)]
                hits = [h for h in hours if h is not None]
                row[hours_target_column(tgt)] = hours_text(sum(hits) / len(hits)) if hits else DASH
                stats["sim_hours_to_target"] = hours
        for key, header in COMM_COLUMNS:
            vals = [v for v in (_final(r, key) for r in g.runs) if v is not None]
            row[header] = f"{sum(vals) / len(vals) / 1e6:,.2f}" if vals else DASH
            stats[key] = vals
        setup = [v for v in (_final(r, "comm/bytes_setup") for r in g.runs) if v is not None]
        if setup:
            row["MB setup"] = f"{sum(setup) / len(setup) / 1e6:,.2f}"
            stats["comm/bytes_setup"] = setup
        row["_stats"] = stats
        row["_runs"] = [r.name for r in g.runs]
        rows.append(row)
    return rows


def footnote(rows: Sequence[dict]) -> str:
    cols = _columns(rows)
    parts = [
        "mean ± sample std (ddof=1) over seeds; std is 0 for a single seed. accuracy: global model, top-1 on "
        f"the test split at the last round; last {LAST_N}: the same averaged over the last {LAST_N} evaluated "
        "rounds; AMP / FM / WLP: FedKF Def. 1-3 on the clients' test splits; FM is the population "
        "variance of client accuracy in fraction² ×10⁻³, as FedKF Tables V-VII print it."
    ]
    if VAL_COLUMN in cols:
        parts.append("val: the same accuracy on the validation set held out of the training set "
                     "(data.val_per_class), at the last round.")
    if ATTACK_COLUMN in cols:
        parts.append("attack success: the backdoor's share of triggered test images of other classes the global "
                     "model calls the target, at the last round (docs/adversaries.md).")
    if EPSILON_COLUMN in cols:
        parts.append("ε: client-level DP's epsilon at the run's privacy.delta after its last round, from "
                     "dp-accounting (docs/privacy.md).")
    if any(header in cols for _, header in ADVERSARY_COLUMNS):
        parts.append("malicious (kept) a round: the malicious clients among a server step's uploads (among those "
                     "Krum kept), mean over the rounds and seeds.")
    if any(c.startswith("rounds to ") for c in cols):
        parts.append(
            "rounds to target: first evaluated round with accuracy ≥ target, mean over the seeds that reach it."
        )
    if any(c.startswith("MB to ") for c in cols):
        parts.append("MB to target: bytes sent up and down until that round, mean over the seeds that reach it.")
    if any(c.startswith("sim h to ") for c in cols):
        parts.append("sim h to target: the simulated clock (system.*, docs/system.md) at that round, in hours, mean "
                     "over the seeds that reach it.")
    parts.append("MB: total bytes sent over the run (10⁶ bytes), mean over seeds.")
    return " ".join(parts)


def _columns(rows: Sequence[dict]) -> list[str]:
    """Every row's display columns, in first-seen order (``MB setup`` exists only for some methods)."""
    return list(dict.fromkeys(c for row in rows for c in row if not c.startswith("_")))


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
        lines.append("| " + " | ".join(_cell(row.get(c, DASH)) for c in cols) + " |")
    return "\n".join(lines) + "\n\n" + footnote(rows) + "\n"
