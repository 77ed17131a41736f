"""Sweep specs for ``fedray tune``: a base config, overrides, a search space over any config key, the
metric to optimise and an optional ASHA scheduler over rounds. Validated up front; executed by Ray Tune
in :mod:`fedray.sweep.runner` (with the runtime, the only places that import Ray).

A spec (``tune_configs/*.yaml``)::

    base: quickstart                      # preset or YAML path, as for `fedray run`
    overrides:                            # dotted keys applied to every trial
      federation.rounds: 30
      data.val_per_class: 500             # a validation set held out of the training set
    search:                               # one domain per key
      data.alpha: {grid: [0.1, 1.0]}
      algorithm.name: {choice: [fedavg, fedprox]}
      federation.lr: {loguniform: [0.001, 0.1]}
      algorithm.mu: {uniform: [0.0, 0.1]}
    metric: val/accuracy                  # chosen on validation data; eval/* (test data) gets a printed note
    mode: max
    last_rounds: 5                        # a trial's figure: the metric over its last 5 evaluated rounds;
                                          # with a seed dimension, a setting's: the mean over its seeds
    num_samples: 1                        # repeats of the grid, random domains redrawn (grids alone: refused)
    scheduler: {type: asha, grace_period: 5, reduction_factor: 3}

``searcher`` says how settings are chosen:

- ``grid``: every combination of the grids (every dimension a grid); the default when every one is.
- ``random``: the grids' combinations, the other dimensions drawn at random, ``num_samples`` times; the
  default otherwise. Draws come from ``searcher_seed``: the same spec draws the same settings.
- ``optuna``: Optuna's TPE sampler through Ray Tune's integration (``OptunaSearch``) proposes
  ``num_samples`` settings of the sampled dimensions, each from the results of those before it; the first
  ``startup_trials`` are random draws. A ``seed: {grid: [...]}`` dimension is not searched: every proposed
  setting runs with each seed and TPE is told the mean of their values (:mod:`fedray.sweep.searcher`).
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedray.methods import load_experiment
from fedray.config import ExperimentConfig
from fedray.load import read_yaml_mapping
from fedray.errors import ConfigError, ResourceError
from fedray.paths import PATH_KEYS, absolute_path
from fedray.validation import config_error


class Domain(BaseModel):
    """Exactly one of: ``grid`` (every value), ``choice`` (sampled), ``uniform`` / ``loguniform`` [low, high]."""

    model_config = ConfigDict(extra="forbid")
    grid: list[Any] | None = None
    choice: list[Any] | None = None
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None

    @model_validator(mode="after")
    def _one(self) -> "Domain":
        set_ = [k for k in ("grid", "choice", "uniform", "loguniform") if getattr(self, k) is not None]
        if len(set_) != 1:
            raise ValueError("give exactly one of grid, choice, uniform, loguniform")
        for k in ("grid", "choice"):
            if getattr(self, k) == []:
                raise ValueError(f"{k} needs at least one value")
        for k in ("uniform", "loguniform"):
            lo_hi = getattr(self, k)
            if lo_hi is not None and not lo_hi[0] < lo_hi[1]:
                raise ValueError(f"{k} needs [low, high] with low < high")
        if self.loguniform is not None and self.loguniform[0] <= 0:
            raise ValueError("loguniform needs low > 0")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("grid", "choice", "uniform", "loguniform") if getattr(self, k) is not None)

    def probe_values(self) -> list[Any]:
        """Values that must all make a valid config: every listed value, or both bounds."""
        return list(getattr(self, self.kind))


class SchedulerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["asha"] = "asha"
    grace_period: int = Field(default=1, ge=1, description="rounds every trial gets before it can be stopped")
    reduction_factor: float = Field(default=3.0, gt=1)


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, description="default: the spec file's stem")
    base: str = "quickstart"
    overrides: dict[str, Any] = Field(default_factory=dict)
    search: dict[str, Domain]
    metric: str = "eval/accuracy"
    mode: Literal["max", "min"] = "max"
    last_rounds: int = Field(default=5, ge=1, description="a trial's figure for choosing the best: its metric "
                             "averaged over its last N evaluated rounds (5, as fedray report's 'last 5': at alpha=0.1 "
                             "one round swings 10-20 points); 1: the last round alone")
    num_samples: int = Field(default=1, ge=1, description="repeats of the search (grid, random); the number of "
                             "settings TPE proposes (optuna), each run with every seed")
    searcher: Literal["grid", "random", "optuna"] | None = Field(
        default=None, description="grid | random | optuna (TPE); default: grid when every dimension is a grid, "
        "else random")
    searcher_seed: int = Field(default=0, description="seeds the random draws and TPE: same spec, same settings")
    startup_trials: int = Field(default=10, ge=1, description="optuna: settings drawn at random before TPE models "
                                "the results (Optuna's n_startup_trials)")
    max_concurrent: int | None = Field(default=None, ge=1)
    scheduler: SchedulerSpec | None = None
    trial_cpus: float = Field(default=0.25, gt=0, description="CPU reserved for each trial's round loop")
    storage: str = Field(default="runs/tune", description="where Tune keeps sweep state (for --resume)")

    @property
    def search_method(self) -> str:
        """``searcher``, or its default: grid when every dimension is a grid, else random."""
        if self.searcher is not None:
            return self.searcher
        return "grid" if all(d.grid is not None for d in self.search.values()) else "random"

    @property
    def seeds(self) -> list[Any] | None:
        """The values of a ``seed`` dimension, which optuna runs every setting with; None without one."""
        domain = self.search.get("seed")
        return None if domain is None else list(getattr(domain, domain.kind))

    def base_config(self) -> ExperimentConfig:
        return load_experiment(self.base, self.overrides)

    def trial_config(self, sampled: dict[str, Any]) -> ExperimentConfig:
        """The config of one trial: base, overrides, then its sampled values. Trials never track to
        MLflow themselves: the sweep's driver records them as child runs."""
        cfg = load_experiment(self.base, {**self.overrides, **sampled, "tracking.enabled": False})
        if cfg.runtime.backend == "ray" and cfg.runtime.num_workers is None:
            # A trial's workers are reserved up front in its placement group: one each unless asked.
            cfg = load_experiment(self.base, {**self.overrides, **sampled, "tracking.enabled": False,
                                          "runtime.num_workers": 1})
        return cfg


def trial_bundles(cfg: ExperimentConfig, trial_cpus: float) -> list[dict[str, float]]:
    """Placement-group bundles of one trial: its round loop, its server actor, its client workers.

    With the ``local`` backend everything runs in the trial's own process, which then takes one
    worker's share. Bundles with no resources are left out (Ray refuses empty bundles).
    """
    rt = cfg.runtime
    if rt.backend == "local":
        return [{"CPU": max(trial_cpus, rt.num_cpus_per_worker), **({"GPU": rt.num_gpus_per_worker}
                                                                   if rt.num_gpus_per_worker else {})}]
    bundles = [{"CPU": trial_cpus}]
    server = {k: v for k, v in (("CPU", rt.server_num_cpus), ("GPU", rt.server_num_gpus)) if v}
    if server:
        bundles.append(server)
    worker = {"CPU": rt.num_cpus_per_worker, **({"GPU": rt.num_gpus_per_worker} if rt.num_gpus_per_worker else {})}
    bundles += [dict(worker) for _ in range(rt.num_workers or 1)]
    return bundles


def load_spec(path: str | Path, name: str | None = None) -> SweepSpec:
    """Read and validate a spec, including every value of its search space against the config schema."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("SPEC", f"{path} does not exist; give a sweep spec such as tune_configs/fedprox_mu.yaml")
    raw = read_yaml_mapping(path, "SPEC")
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as e:
        raise config_error(e, SweepSpec) from None
    spec.name = name or spec.name or path.stem
    base = spec.base_config()  # the base must exist (a preset name or a file) and be valid
    _anchor_paths(spec, base)
    for key, domain in spec.search.items():
        for value in domain.probe_values():
            try:
                spec.trial_config({key: value})
            except ConfigError as e:
                raise ConfigError(f"search.{key}", f"value {value!r} is invalid: {e}") from None
    check_searcher(spec)
    known = set(base.flat()) | {"round", "train/loss", "time/round_s", "comm/bytes_up", "comm/bytes_down"}
    if not (spec.metric.startswith(("eval/", "val/", "server/", "train/", "comm/", "time/", "diag/"))
            or spec.metric in known):
        raise ConfigError("metric", f"'{spec.metric}' is not a per-round metric; e.g. val/accuracy, eval/accuracy")
    if spec.metric.startswith("val/") and not base.data.val_per_class and "data.val_per_class" not in spec.search:
        raise ConfigError("metric", f"'{spec.metric}' is scored on a validation set, and the base config has none; "
                          "add one to the spec: overrides: {data.val_per_class: 500}")
    return spec


def check_searcher(spec: SweepSpec) -> None:
    """Refuse a search space the chosen searcher cannot run, naming the dimension and the fix."""
    method = spec.search_method
    if method == "grid":
        for key, domain in spec.search.items():
            if domain.grid is None:
                raise ConfigError(f"search.{key}", f"searcher grid runs grids only, and this is {domain.kind}; "
                                  f"give it as {{grid: [...]}} or use searcher: random")
    if method != "optuna":
        return
    sampled = [k for k in spec.search if k != "seed"]
    if not sampled:
        raise ConfigError("searcher", "optuna needs a dimension to search besides seed; add one under search:")
    for key in sampled:
        if spec.search[key].grid is not None:
            raise ConfigError(f"search.{key}", "searcher optuna proposes every value itself and runs no grid; "
                              f"give it as {{choice: {spec.search[key].grid}}} (or uniform / loguniform)")
    if "seed" in spec.search and spec.search["seed"].grid is None:
        raise ConfigError("search.seed", "with searcher optuna every setting runs with each seed: give the seeds as "
                          "{grid: [0, 1, 2]}")


def _anchor_paths(spec: SweepSpec, base: ExperimentConfig) -> None:
    """Relative paths of the spec made absolute here, where the sweep starts: Tune runs each trial in a folder
    of its own, where ``data.data_dir: data`` or a ``base: my.yaml`` would name nothing (every trial failed).
    The base config's folders (already absolute, see :func:`fedray.paths.absolute_path`) are pinned as
    overrides for the same reason."""
    if Path(spec.base).suffix in (".yaml", ".yml") or Path(spec.base).exists():
        spec.base = absolute_path(os.path.expanduser(spec.base))  # read here and by every trial
    flat = base.flat()
    for key in PATH_KEYS:
        if key in spec.search:
            domain = spec.search[key]
            if domain.kind in ("grid", "choice"):
                setattr(domain, domain.kind, [absolute_path(v) if isinstance(v, str) else v
                                              for v in getattr(domain, domain.kind)])
        elif isinstance(spec.overrides.get(key), str):
            spec.overrides[key] = absolute_path(spec.overrides[key])
        elif flat.get(key) is not None:
            spec.overrides[key] = flat[key]


@dataclass
class TrialRow:
    """A finished trial as the sweep's choice sees it: its config, its last reported figures, its folder, and
    ``value``, its metric averaged over its last ``last_rounds`` evaluated rounds (:func:`trial_value`)."""

    config: dict[str, Any]
    figures: dict[str, Any]
    path: str
    value: float


def trial_value(history: list[float | None], spec: SweepSpec) -> float | None:
    """The mean of a trial's metric over its last ``spec.last_rounds`` finite values (rounds that reported it);
    None when it reported none."""
    values = [float(v) for v in history if isinstance(v, (int, float)) and math.isfinite(v)][-spec.last_rounds:]
    return float(np.mean(values)) if values else None


def best_setting(rows: list[TrialRow], spec: SweepSpec) -> dict[str, Any]:
    """The sweep's best from its finished trials, each judged by :attr:`TrialRow.value`.

    With a ``seed`` dimension the trials of one setting (the same values but the seed) are taken together and
    the best setting is the one whose mean value over its seeds is best: one seed's lucky run is no choice of
    hyperparameters. ``config`` is then the setting without its seed, ``metrics`` each last-round figure
    averaged over the seeds, and ``seeds``, ``metric_per_seed`` and ``metric_std`` (sample, ddof=1; 0 for one
    seed) say what the mean is of. Without a seed dimension, the best trial."""
    sign = 1.0 if spec.mode == "max" else -1.0
    scope = {"metric_rounds": f"mean of the last {spec.last_rounds} evaluated rounds" if spec.last_rounds > 1
             else "the last round"}
    if "seed" not in spec.search:
        best = max(rows, key=lambda r: sign * r.value)
        return {"config": dict(best.config), "metric_value": best.value, **scope, "metrics": _figures(best.figures),
                "trial_dir": best.path}
    groups: dict[tuple, list[TrialRow]] = {}
    for row in rows:
        groups.setdefault(tuple(sorted((k, repr(v)) for k, v in row.config.items() if k != "seed")), []).append(row)
    trials = sorted(max(groups.values(), key=lambda g: sign * float(np.mean([r.value for r in g]))),
                    key=lambda r: r.config["seed"])
    values = [r.value for r in trials]
    figures = [_figures(r.figures) for r in trials]
    shared = [k for k in figures[0] if all(isinstance(f.get(k), (int, float)) for f in figures)]
    return {"config": {k: v for k, v in trials[0].config.items() if k != "seed"},
            "metric_value": float(np.mean(values)), **scope,
            "metric_std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
            "seeds": [r.config["seed"] for r in trials],
            "metric_per_seed": {str(r.config["seed"]): v for r, v in zip(trials, values)},
            "metrics": {k: float(np.mean([f[k] for f in figures])) for k in shared},
            "trial_dirs": [r.path for r in trials]}


def _figures(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if "/" in k or k == "round"}


def selects_on_test_data(spec: SweepSpec) -> bool:
    """Whether the sweep picks its best trial by a figure of the test data (``eval/*``: the global test set or
    the clients' test splits), which then no longer measures how the chosen setting generalises."""
    return spec.metric.startswith("eval/")


def check_repeats(spec: SweepSpec, num_samples: int | None = None, key: str = "num_samples") -> None:
    """Refuse repeats that can only copy trials: with grid dimensions alone, every repeat of the search is the
    same configs with the same seed, so the same numbers, yet they would pass for independent trials."""
    n = num_samples or spec.num_samples
    if n > 1 and all(d.grid is not None for d in spec.search.values()):
        raise ConfigError(key, f"{n} repeats of a search of grids only run identical trials (same configs, same "
                          "seed, same numbers); for seeds, search seed: {grid: [0, 1, 2]}; repeats draw the choice, "
                          "uniform and loguniform dimensions anew")


def search_space_summary(spec: SweepSpec) -> dict[str, str]:
    """``search.<key> -> "grid [..]"``: logged as the sweep's MLflow params."""
    return {f"search.{k}": f"{d.kind} {getattr(d, d.kind)}" for k, d in spec.search.items()}


def planned_trials(spec: SweepSpec, num_samples: int | None = None) -> list[dict[str, Any]]:
    """The trials a sweep would start, in Tune's order (every grid combination, ``num_samples`` times): each
    one's values (a sampled domain shown as the domain, drawn when the trial starts) and resource bundles."""
    grid_keys = [k for k, d in spec.search.items() if d.grid is not None]
    combos = list(itertools.product(*(spec.search[k].grid for k in grid_keys)))
    trials = []
    for sample in range(num_samples or spec.num_samples):
        for combo in combos:
            values: dict[str, Any] = {}
            concrete: dict[str, Any] = {}
            for key, domain in spec.search.items():
                if domain.grid is not None:
                    values[key] = concrete[key] = combo[grid_keys.index(key)]
                else:
                    values[key] = f"{domain.kind} {list(getattr(domain, domain.kind))}"
                    concrete[key] = domain.probe_values()[0]
            trials.append({"trial": len(trials), "sample": sample, "values": values,
                           "bundles": trial_bundles(spec.trial_config(concrete), spec.trial_cpus)})
    return trials


def check_trials_fit(trials: list[list[dict[str, float]]], resources: dict[str, float],
                     node_resources: list[dict[str, float]]) -> None:
    """Refuse a sweep with a trial that the Ray cluster (``resources`` in all, ``node_resources`` per node) can
    never place: Tune would wait for it without end. A bundle must fit on one node, a trial's bundles together
    in the cluster."""
    biggest = max((n.get("CPU", 0.0) for n in node_resources), default=resources.get("CPU", 0.0))
    fix = "lower trial_cpus, runtime.num_cpus_per_worker / num_gpus_per_worker or runtime.num_workers"
    for bundles in trials:
        for res, key in (("CPU", "trial_cpus"), ("GPU", "runtime.num_gpus_per_worker")):
            need, have = sum(b.get(res, 0.0) for b in bundles), resources.get(res, 0.0)
            if need > have + 1e-9:
                raise ResourceError(key, f"a trial reserves {need:g} {res} ({format_bundles(bundles)}) but the Ray "
                                    f"cluster has {have:g}; {fix}")
        largest = max(b.get("CPU", 0.0) for b in bundles)
        if largest > biggest + 1e-9:
            raise ResourceError("trial_cpus", f"a trial's bundle of {largest:g} CPU ({format_bundles(bundles)}) "
                                f"fits on no node (the largest has {biggest:g}); {fix}")


def search_plan(spec: SweepSpec, num_samples: int | None = None, at_once: int | None = None) -> str:
    """What the sweep will do, in words (``fedray tune --dry-run``): how settings are chosen, how many trials,
    what each is judged by, and the scheduler."""
    n = num_samples or spec.num_samples
    judged = (f"{spec.metric} ({spec.mode}) over its last {spec.last_rounds} evaluated rounds" if spec.last_rounds > 1
              else f"{spec.metric} ({spec.mode}) at its last round")
    seeds = spec.seeds
    if spec.search_method == "optuna":
        runs = f" x {len(seeds)} seeds = {n * len(seeds)} trials" if seeds else " (one trial each)"
        lines = [f"searcher optuna: TPE (sampler seed {spec.searcher_seed}) proposes {n} settings{runs}; the first "
                 f"{min(spec.startup_trials, n)} drawn at random, each later one from the results told before it",
                 f"at most {at_once or '(as many as the cluster holds)'} trials at once, and the proposals depend on "
                 "that number: same spec, seed and number, same settings"]
    else:
        how = ("every combination of the grids" if spec.search_method == "grid" else
               f"the grids' combinations with the other dimensions drawn at random (seed {spec.searcher_seed})")
        lines = [f"searcher {spec.search_method}: {how}, {n} time{'s' if n > 1 else ''}"]
    if seeds:
        lines.append(f"each setting judged by the mean over its seeds {seeds} of each trial's {judged}")
    else:
        lines.append(f"each trial judged by its {judged}")
    if spec.scheduler is not None:
        lines.append(f"ASHA stops trials early at rounds {spec.scheduler.grace_period} x "
                     f"{spec.scheduler.reduction_factor:g}^k")
    return "\n".join(lines)


def concurrency(spec: SweepSpec, trials: list[list[dict[str, float]]], resources: dict[str, float],
                max_concurrent: int | None = None) -> int | None:
    """How many trials run at once: ``max_concurrent`` (the command line's), else the spec's, else as many as
    the cluster's CPUs and GPUs hold (None: no limit, Tune's default, for grid and random searches). An
    optuna search always gets a number: its proposals depend on it (:class:`fedray.sweep.searcher.SeedAveragedSearch`)."""
    given = max_concurrent or spec.max_concurrent
    if given or spec.search_method != "optuna":
        return given
    fits = []
    for res in ("CPU", "GPU"):
        need = max(sum(b.get(res, 0.0) for b in bundles) for bundles in trials)
        if need > 0:
            fits.append(int(resources.get(res, 0.0) / need + 1e-9))
    return max(1, min(fits)) if fits else 1


def format_bundles(bundles: list[dict[str, float]]) -> str:
    """``[CPU 0.5] [CPU 0.5, GPU 0.25]``: one bracket per placement-group bundle."""
    return " ".join("[" + ", ".join(f"{k} {v:g}" for k, v in b.items()) + "]" for b in bundles)
