"""How a sweep chooses its trials: Tune's variant generator for ``grid`` and ``random``, and for ``optuna``
Optuna's TPE (Ray Tune's ``OptunaSearch``) behind :class:`SeedAveragedSearch`, which runs every setting TPE
proposes with each seed of the spec and tells TPE their mean.

Every trial reports ``sweep/value`` each round (:class:`fedray.sweep.runner._TuneReport`): the spec's metric
averaged over the trial's last ``last_rounds`` evaluated rounds, the figure ``best.json`` judges a trial by.
TPE is told the same figure (its mean over seeds), so the model-based search and the sweep's choice agree.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

from ray.tune.search import BasicVariantGenerator, Searcher
from ray.tune.search.optuna import OptunaSearch

from fedray.sweep.spec import SweepSpec

#: the figure each trial reports for the searcher (and that best.json recomputes from the history)
VALUE_KEY = "sweep/value"

_RUNNING = "running"  # a seed's trial that has not completed (a string: it survives pickling for --resume)


def search_algorithm(spec: SweepSpec, space: dict[str, Any], max_concurrent: int, num_samples: int):
    """The Tune search algorithm of ``spec``: ``space`` is its search space as Tune domains; ``num_samples``
    the number of settings (optuna) or repeats (grid, random)."""
    if spec.search_method != "optuna":
        # Seeded: a random search draws the same settings each time the spec runs
        return BasicVariantGenerator(max_concurrent=max_concurrent, random_state=spec.searcher_seed)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per trial from Optuna is noise in our console
    sampled = {k: v for k, v in space.items() if k != "seed"}
    inner = OptunaSearch(space=OptunaSearch.convert_search_space(sampled), metric=spec.metric, mode=spec.mode,
                         sampler=optuna.samplers.TPESampler(seed=spec.searcher_seed,
                                                            n_startup_trials=spec.startup_trials))
    return SeedAveragedSearch(inner, spec.seeds, spec.metric, spec.mode, max_concurrent, num_samples)


class SeedAveragedSearch(Searcher):
    """Asks a model-based searcher (``inner``) for settings, runs each with every seed, tells it their mean.

    - A setting's seeds start one after another, before the next setting is asked for.
    - ``inner`` is told a setting once all its seeds' trials have completed: the mean of their
      :data:`VALUE_KEY` (trials that failed, or stopped before any evaluation, left out; none left: failed).
    - Same spec, same settings: before proposing setting n, ``inner`` has been told exactly settings
      0 .. n - window, where ``window`` is how many settings can run at once (1 + (``max_concurrent`` - 1) /
      seeds, rounded up).
      Told in setting order, whichever trial finishes first, so a concurrent sweep proposes what a sequential
      one with the same ``max_concurrent`` would; a setting that lags holds back the proposal ``window`` later.
    - At most ``max_concurrent`` trials run at once (this searcher limits them itself).
    """

    def __init__(self, inner: OptunaSearch, seeds: list[Any] | None, metric: str, mode: str, max_concurrent: int,
                 num_settings: int):
        super().__init__(metric=metric, mode=mode)
        self.inner = inner
        self.seeds = list(seeds) if seeds else [None]
        self.max_concurrent = max(1, int(max_concurrent))
        # settings that may run at once: one, plus those the other max_concurrent - 1 trials can start
        self.window = 1 + math.ceil((self.max_concurrent - 1) / len(self.seeds))
        self.num_settings = num_settings
        self.settings: list[dict[str, Any]] = []  # setting n's proposed values
        self.values: list[list[Any]] = []  # setting n: each seed's value, _RUNNING until its trial completes
        self.pending: list[tuple[int, int]] = []  # (setting, seed index) not yet started
        self.trial_of: dict[str, tuple[int, int]] = {}
        self.live: set[str] = set()
        self.told = 0  # settings 0 .. told-1 have been told to inner

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # built with its metric, mode and space (search_algorithm)

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if len(self.live) >= self.max_concurrent:
            return None
        if not self.pending:
            n = len(self.settings)
            if n >= self.num_settings:
                return Searcher.FINISHED
            if not self._tell_through(n - self.window):
                return None  # waits for an earlier setting: asked again when a trial completes
            params = self.inner.suggest(_setting_id(n))
            if params is None:
                return None
            self.settings.append(dict(params))
            self.values.append([_RUNNING] * len(self.seeds))
            self.pending = [(n, i) for i in range(len(self.seeds))]
        n, i = self.pending.pop(0)
        self.trial_of[trial_id] = (n, i)
        self.live.add(trial_id)
        seed = self.seeds[i]
        return {**self.settings[n], **({} if seed is None else {"seed": seed})}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self.trial_of:
            return
        self.live.discard(trial_id)
        n, i = self.trial_of[trial_id]
        value = None if error or not result else result.get(VALUE_KEY)
        self.values[n][i] = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    def _tell_through(self, last: int) -> bool:
        """Tell ``inner`` settings up to ``last``, in order; False while one of them still runs."""
        while self.told <= last:
            values = self.values[self.told]
            if any(v == _RUNNING for v in values):
                return False
            done = [v for v in values if v is not None]
            self.inner.on_trial_complete(_setting_id(self.told),
                                         {self.metric: sum(done) / len(done)} if done else None, error=not done)
            self.told += 1
        return True

    def setting_values(self) -> list[tuple[dict[str, Any], list[Any]]]:
        """Each proposed setting with its seeds' values so far (None: failed; "running": not completed)."""
        return list(zip(self.settings, self.values))

    # Tune saves the searcher with the sweep's state, so that `fedray tune --resume` goes on proposing from it
    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as fh:
            pickle.dump(self.__dict__, fh)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as fh:
            self.__dict__.update(pickle.load(fh))


def _setting_id(n: int) -> str:
    return f"setting_{n:04d}"
