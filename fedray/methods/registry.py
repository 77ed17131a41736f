"""Federated methods, one module each, found by ``algorithm.name``."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from fedray.system.protocol import schedule_class
from fedray.config import ExperimentConfig
from fedray.load import load_config
from fedray.errors import ConfigError
from fedray.learning.robust import VALUE_RULES
from fedray.methods.api import Algorithm, CacheParams, ClientContext, ClientResult, DataSpec, ServerContext
from fedray.models import MODEL_NAMES


class _Registry(MutableMapping):
    """``algorithm.name`` -> method class. A built-in method's module is imported when its name is first looked
    up (or the registry listed), not with this package: every Ray actor imports the package, and importing all
    the methods cost each process ~0.1 s of CPU on a start-up that is CPU-bound (``benchmarks/README.md``)."""

    def __init__(self, builtin: dict[str, str]):
        self._builtin = builtin  # name -> "module:Class"
        self._classes: dict[str, type[Algorithm]] = {}

    def __getitem__(self, name: str) -> type[Algorithm]:
        if name not in self._classes and name in self._builtin:
            module, _, attr = self._builtin[name].partition(":")
            self._classes[name] = getattr(importlib.import_module(module), attr)
        return self._classes[name]

    def __setitem__(self, name: str, cls: type[Algorithm]) -> None:
        self._classes[name] = cls

    def __delitem__(self, name: str) -> None:
        self._builtin.pop(name, None)
        del self._classes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._builtin, *self._classes]))

    def __len__(self) -> int:
        return len(self._builtin.keys() | self._classes.keys())


# Built-in methods: one line each.
ALGORITHMS: MutableMapping[str, type[Algorithm]] = _Registry({
    "fedavg": "fedray.methods.fedavg:FedAvg",
    "fedprox": "fedray.methods.fedprox:FedProx",
    "scaffold": "fedray.methods.scaffold:Scaffold",
    "dafkd": "fedray.methods.dafkd.method:DaFKD",
    "fedkf": "fedray.methods.fedkf:FedKF",
    "qffl": "fedray.methods.qffl:QFFL",
    "fedgkd": "fedray.methods.fedgkd:FedGKD",
    "local": "fedray.methods.local:Local",
    "fedcd": "fedray.methods.fedcd:FedCD",
    "feddistill": "fedray.methods.feddistill:FedDistill",
    "feddf": "fedray.methods.feddf:FedDF",
    "fedd3a": "fedray.methods.fedd3a:FedD3A",
    "fedgen": "fedray.methods.fedgen:FedGen",
    "fedftg": "fedray.methods.fedftg:FedFTG",
})


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Make a user-defined method runnable as ``algorithm.name=<cls.name>`` (usable as a decorator).

    The class is shipped to Ray workers by value when it lives in ``__main__`` (cloudpickle), so a
    method defined in the user's own script runs on a cluster unchanged.
    """
    existing = ALGORITHMS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"algorithm name '{cls.name}' is already taken by {existing.__qualname__}")
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            "algorithm.name", f"unknown algorithm '{name}'; allowed: {', '.join(sorted(ALGORITHMS))}"
        ) from None


@dataclass(frozen=True)
class Experiment:
    """An experiment resolved once, before any work: the checked config, its method's class and its parsed
    ``algorithm.*`` parameters. The simulation, the runtime and every worker are handed this; none of them looks a
    method up by name or parses its parameters again."""

    cfg: ExperimentConfig
    method: type[Algorithm]
    params: BaseModel
    #: a channel of the caller's own (a test's stage, :class:`fedray.channel.channel.Channel`); None: the runtime
    #: builds the one ``cfg.channel`` configures (methods never know the channel)
    channel: Any = None

    def build(self, spec: DataSpec) -> Algorithm:
        """The method's instance for data of ``spec`` (one per process: a worker, the server, the driver)."""
        return self.method(self.cfg, spec, self.params)


def resolve_experiment(cfg: "ExperimentConfig | Experiment") -> Experiment:
    """What ``fedray.config`` cannot check without the registries: the algorithm's name and parameters, the
    method's declarations against the config (the one place that says which modes a method supports), its own
    ``check_config``, the model names, and that a method which averages parameters gets one architecture; raises
    :class:`ConfigError` naming the key. An :class:`Experiment` is returned as it is (resolved already)."""
    if isinstance(cfg, Experiment):
        return cfg
    method = get_algorithm(cfg.algorithm.name)
    params = method.parse_params(cfg.algorithm.params())
    check_declarations(method, params, cfg)
    method.check_config(cfg, params)
    if cfg.model.name not in MODEL_NAMES:
        raise ConfigError("model.name", f"unknown model {cfg.model.name!r}; allowed: {', '.join(MODEL_NAMES)}")
    if cfg.model.client_models is not None:
        unknown = [m for m in cfg.model.client_models if m not in MODEL_NAMES]
        if unknown or not cfg.model.client_models:
            raise ConfigError("model.client_models", f"{cfg.model.client_models} must be a non-empty list of "
                              f"model names; allowed: {', '.join(MODEL_NAMES)}")
        others = sorted(set(cfg.model.client_models) - {cfg.model.name})
        if method.shared_architecture and others:
            raise ConfigError("model.client_models", f"'{method.name}' averages parameters, so every client must "
                              f"train model.name={cfg.model.name}, not {', '.join(others)}; drop "
                              "model.client_models or use a method with per-client models "
                              f"({', '.join(n for n, c in sorted(ALGORITHMS.items()) if not c.shared_architecture)})")
    if cfg.model.init:  # read and checked against the model for this data's shape, before any work
        from fedray.data.datasets import input_spec
        from fedray.models.init import initial_weights

        initial_weights(cfg.model.init, cfg.model.name, *input_spec(cfg.data))
    return Experiment(cfg, method, params)


def check_declarations(method: type[Algorithm], params: BaseModel, cfg: "ExperimentConfig") -> None:
    """The rules of a method's declarations (:class:`Algorithm`'s ``asynchronous``, ``keeps_cache``,
    ``robust_means``) against the run's config: the one place where the modes a method supports are checked."""
    mode = cfg.federation.mode
    stale = schedule_class(mode).stale  # the schedule steps over uploads trained from older models
    if cfg.data.on_demand:
        _check_on_demand(method, params, cfg)
    if stale and not method.asynchronous:
        able = ", ".join(n for n, c in sorted(ALGORITHMS.items()) if c.asynchronous and c.__module__.startswith(
            "fedray."))
        raise ConfigError("federation.mode", f"'{method.name}' cannot run {mode}: its server step needs one "
                          f"synchronous cohort ({method.synchronous_because}); methods that can: {able}")
    if cfg.adversary.enabled:
        from fedray.data.datasets import input_spec

        shape, classes = input_spec(cfg.data)
        cfg.adversary.check(cfg.data.num_clients, classes, shape[1:])
    rule = cfg.aggregation.rule
    rules, why = method.robust_rules(params)
    if rule not in rules:
        able = ", ".join(n for n, c in sorted(ALGORITHMS.items()) if c.__module__.startswith("fedray.")
                         and rule in c.robust_rules(c.parse_params({}))[0])
        takes = "only the mean" if rules == ("mean",) else f"the rules {', '.join(rules)}"
        raise ConfigError("aggregation.rule", f"'{method.name}' takes {takes} here: {why}; methods that take {rule} "
                          f"(with their defaults): {able or 'none'}")
    if cfg.privacy.enabled:  # the accountant's refusals: a budget the first round passes, a count noise too small
        from fedray.privacy.accounting import check_budget, update_noise_multiplier

        check_budget(cfg)
        update_noise_multiplier(cfg, method.uploads_label_counts(params))
        if cfg.privacy.mechanism == "local" and method.sends_label_counts(params):
            raise ConfigError("privacy.mechanism", f"'{method.name}' with these parameters reads every client's label "
                              "counts once at set-up, a release outside the rounds' accountant; local noise cannot "
                              "cover it (DaFKD: use alpha_source=discriminator)")
    if cfg.privacy.mechanism == "central":
        # central noise replaces the hook's mean by a noised sum of the clipped uploads: every call of the server
        # step must be such a mean, and nothing the server keeps may come from the uploads unnoised
        why = method.central_noise_refused(params)
        if why is not None:
            able = ", ".join(n for n, c in sorted(ALGORITHMS.items()) if c.__module__.startswith("fedray.")
                             and c.central_noise_refused(c.parse_params({})) is None)
            raise ConfigError("privacy.mechanism", f"'{method.name}' cannot take central noise: {why}; use "
                              f"privacy.mechanism=local (methods that take central with their defaults: {able})")
    if method.keeps_cache:
        if rule not in VALUE_RULES and params.report_model == "oca":
            raise ConfigError("algorithm.report_model", f"the cache's OCA model averages slots trained from the models "
                              f"of older rounds, no one reference for aggregation.rule={rule} to measure updates from; "
                              f"use report_model=aca or a rule of values ({', '.join(VALUE_RULES[1:])})")
        if stale and params.report_model == "oca":
            raise ConfigError("algorithm.report_model", "the cache's slots hold one round's cohort; with "
                              f"federation.mode={mode} use report_model=aca")
    elif isinstance(params, CacheParams) and (params.report_model, params.cache_init) != (None, None):
        key = "algorithm.report_model" if params.report_model is not None else "algorithm.cache_init"
        raise ConfigError(key, f"'{method.name}' keeps no cache (its class does not declare keeps_cache = True), "
                          "so this key would change nothing; drop it")


def algorithm_params(cfg: "ExperimentConfig") -> BaseModel:
    """The parsed ``algorithm.*`` of ``cfg``, checked as :func:`resolve_experiment` checks it."""
    return resolve_experiment(cfg).params


def _check_on_demand(method: type[Algorithm], params: BaseModel, cfg: "ExperimentConfig") -> None:
    """What clients made on demand do not give yet (each would read every registered client's data or keep a state
    for every one): refused in one line naming the key, before any work."""
    key = "data.partition" if cfg.data.partition == "on_demand" else "data.pseudo_base_clients"
    if method.sends_label_counts(params):
        raise ConfigError(key, f"'{method.name}' with these parameters reads every client's label counts at "
                          "set-up, which would make every client; use an eager partition")
    if cfg.privacy.mia_samples:
        raise ConfigError("privacy.mia_samples", "the audit's members are drawn from every client's examples, "
                          "which would make every client; set it 0 with clients made on demand")
    if method.caches(params) and cfg.aggregation.rule != "mean":
        raise ConfigError("aggregation.rule", f"{method.name}'s cache gives every registered client's slot one "
                          f"vote under {cfg.aggregation.rule} (the initial model for each never-filled one), a vote per "
                          "registered client with clients made on demand; use aggregation.rule=mean")


def validate_experiment(cfg: "ExperimentConfig") -> "ExperimentConfig":
    """:func:`resolve_experiment`'s checks, for a caller that keeps the config: ``cfg`` itself."""
    return resolve_experiment(cfg).cfg


def load_experiment(name_or_path: str | None = None, overrides=None) -> "ExperimentConfig":
    """:func:`fedray.load.load_config` followed by :func:`validate_experiment`: a fully checked config."""
    return validate_experiment(load_config(name_or_path, overrides))


__all__ = ["ALGORITHMS", "Algorithm", "ClientContext", "ClientResult", "DataSpec", "Experiment", "ServerContext",
           "algorithm_params", "get_algorithm", "load_experiment", "register_algorithm", "resolve_experiment",
           "validate_experiment"]
