"""Federated methods: the contract (:mod:`fedray.methods.api`), one module per method (a subpackage for a method of
several modules, :mod:`fedray.methods.dafkd`), and the registry that finds a method by ``algorithm.name``
(:mod:`fedray.methods.registry`)."""

from fedray.methods.registry import (ALGORITHMS, Experiment, algorithm_params, get_algorithm, load_experiment,
                                     register_algorithm, resolve_experiment, validate_experiment)
from fedray.methods.api import Algorithm, ClientContext, ClientResult, DataSpec, ServerContext

__all__ = ["ALGORITHMS", "Algorithm", "ClientContext", "ClientResult", "DataSpec", "Experiment", "ServerContext",
           "algorithm_params", "get_algorithm", "load_experiment", "register_algorithm", "resolve_experiment",
           "validate_experiment"]
