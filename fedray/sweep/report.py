"""What a sweep shows its user: one terminal line per trial event, and the metric against each searched
parameter."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from ray import tune

from fedray.record.console import make_console
from fedray.errors import ConfigError
from fedray.sweep.spec import SweepSpec, TrialRow

# In a trial's first report when the checkpoint Tune handed back was gone: the round it went on from (0: from
# scratch). No "/" in the key: it is not a per-round metric.
RESTARTED_KEY = "fedray_checkpoint_gone"


def _trial_rounds(spec: SweepSpec, trial, cache: dict[str, int]) -> int:
    """A trial's ``federation.rounds``, its config built once per trial (``cache``: trial id -> rounds)."""
    if trial.trial_id not in cache:
        cache[trial.trial_id] = spec.trial_config(trial.config).federation.rounds
    return cache[trial.trial_id]


class ConsoleTrialReporter(tune.Callback):
    """One terminal line per trial event, in place of Tune's status block: started (with its sampled values),
    each evaluation (the sweep's metric, and the best so far), finished, stopped early by ASHA, failed, and a
    trial that went on without the checkpoint the sweep's state named."""

    def __init__(self, spec: SweepSpec, console):
        self.spec, self.console = spec, console
        self._rounds: dict[str, int] = {}
        self._last: dict[str, dict[str, Any]] = {}
        self.best: tuple[float, str] | None = None

    def __getstate__(self):  # Tune pickles callbacks into its experiment state; the console stays behind
        return {**self.__dict__, "console": None}

    def __setstate__(self, state):  # a resumed sweep runs the pickled callbacks: print to this terminal
        self.__dict__.update(state)
        self.console = make_console()

    def _say(self, trial, text: str) -> None:
        if self.console is not None:
            self.console.print(f"[{trial.trial_id}] {text}", highlight=False, markup=False, soft_wrap=True)

    def _total(self, trial) -> int:
        return _trial_rounds(self.spec, trial, self._rounds)

    def on_trial_start(self, iteration, trials, trial, **info):
        values = " ".join(f"{k}={v}" for k, v in trial.config.items())
        self._say(trial, f"started   {values}")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._last[trial.trial_id] = result
        total, metric = self._total(trial), self.spec.metric
        if RESTARTED_KEY in result:
            went_on = int(result[RESTARTED_KEY])
            self._say(trial, "its checkpoint in the sweep's saved state was gone (the driver was killed); "
                      + (f"went on from its run directory's checkpoint at round {went_on}" if went_on
                         else "restarted from round 1"))
        value = result.get(metric)
        if value is None:
            return
        sign = 1 if self.spec.mode == "max" else -1
        if self.best is None or sign * value > sign * self.best[0]:
            self.best = (float(value), trial.trial_id)
        self._say(trial, f"round {int(result['round'])}/{total}  {metric} {value:.4f}  "
                         f"(best so far {self.best[0]:.4f}, {self.best[1]})")

    def on_trial_complete(self, iteration, trials, trial, **info):
        total = self._total(trial)
        last = self._last.get(trial.trial_id, {})
        done = int(last.get("round", 0))
        value = last.get(self.spec.metric)
        figure = f"  {self.spec.metric} {value:.4f}" if value is not None else ""
        if done < total:
            self._say(trial, f"stopped by ASHA at round {done}/{total}: its {self.spec.metric} was not in the "
                             f"top 1/{self.spec.scheduler.reduction_factor:g} at a rung{figure}" if self.spec.scheduler
                      else f"ended at round {done}/{total}{figure}")
        else:
            self._say(trial, f"finished  round {done}/{total}{figure}")

    def on_trial_error(self, iteration, trials, trial, **info):
        error = Path(getattr(trial, "error_file", None) or "")
        reason = last_line(error.read_text(errors="replace")) if error.is_file() else None
        self._say(trial, f"failed    {reason} (traceback: {error})" if reason else "failed    see the sweep's ray.log")


def last_line(text: str, limit: int = 200) -> str | None:
    """A trial's error as one line: the last of its text (a traceback, or Tune's wrapper of the trial's
    exception, both end with the cause), cut at ``limit`` characters; None for an empty text."""
    lines = text.strip().splitlines()
    return lines[-1][:limit] if lines else None


class MetricCheck(tune.Callback):
    """Stops a sweep whose ``metric`` its runs do not report (a typo: ``eval/acuracy``), at the first result
    that would hold it, instead of running every trial and ending with no best trial.

    Which results must hold it: a trial's last round (evaluated and diagnosed, every warm-up over), and
    before it an evaluated round for ``eval/*`` and ``val/*`` (each comes with ``eval/accuracy``) or a
    diagnosed one for ``diag/*``. Raised in the driver, the error ends ``fit()``; ``run_sweep`` unwraps it.
    """

    def __init__(self, spec: SweepSpec):
        self.spec = spec
        self._rounds: dict[str, int] = {}

    def _must_hold(self, trial, result: dict[str, Any]) -> bool:
        family = self.spec.metric.split("/", 1)[0]
        return (int(result.get("round", 0)) >= _trial_rounds(self.spec, trial, self._rounds)
                or (family in ("eval", "val") and "eval/accuracy" in result)
                or (family == "diag" and any(k.startswith("diag/") for k in result)))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if self.spec.metric in result or not self._must_hold(trial, result):
            return
        keys = sorted(k for k in result if "/" in k)
        close = difflib.get_close_matches(self.spec.metric, keys, n=1)
        raise ConfigError("metric", f"'{self.spec.metric}' is not reported by this sweep's runs (trial "
                          f"{trial.trial_id}, round {result.get('round')}: {', '.join(keys)})"
                          + (f"; did you mean '{close[0]}'?" if close else ""))


def plot_sweep(trials: list[TrialRow], spec: SweepSpec, best: dict[str, Any], path: Path) -> Path | None:
    """Each trial's value (its metric over its last ``spec.last_rounds`` evaluated rounds) against each searched
    parameter, one panel per parameter, ``best`` marked (the best trial, or the best setting at its mean over
    seeds); None when no trial reported the metric."""
    rows = [(t.config, t.value) for t in trials]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(spec.search)
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    label = "best" + (" (mean over seeds)" if "seeds" in best else "")
    for ax, key in zip(axes[0], keys):
        values = [cfg.get(key) for cfg, _ in rows]
        bx = best["config"].get(key)  # None on the seed panel of a best setting
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            xs, positive = values, [v for v in values if v > 0]
            if spec.search[key].kind == "loguniform" or (
                    positive and min(values) >= 0 and max(positive) >= 100 * min(positive)):
                # a grid with 0 (FedProx's mu: 0, 0.001, ..., 1) on a log scale that is linear near 0
                ax.set_xscale("log") if min(values) > 0 else ax.set_xscale("symlog", linthresh=min(positive))
        else:  # categories, in order of first appearance
            labels = list(dict.fromkeys(map(str, values)))
            xs, bx = [labels.index(str(v)) for v in values], labels.index(str(bx)) if key in best["config"] else None
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.scatter(xs, [m for _, m in rows], alpha=0.7)
        ax.margins(x=0.15)
        if bx is not None:
            ax.scatter([bx], [best["metric_value"]], marker="*", s=200, color="tab:red", label=label)
        ax.set_xlabel(key)
        ax.set_ylabel(spec.metric)
        ax.grid(alpha=0.3)
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
            break
    fig.suptitle(f"{spec.name}: {len(rows)} trials, {spec.metric}"
                 + (f", mean of the last {spec.last_rounds} evaluated rounds" if spec.last_rounds > 1 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
