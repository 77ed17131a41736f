"""Federated methods, one module each, found by ``algorithm.name``."""

from __future__ import annotations

from fedray.algorithms.base import Algorithm, ClientContext, ClientResult, DataSpec, ServerContext
from fedray.errors import ConfigError

ALGORITHMS: dict[str, type[Algorithm]] = {}


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


# Built-in methods: one import and one registration line each.
from fedray.algorithms.fedavg import FedAvg  # noqa: E402

register_algorithm(FedAvg)
from fedray.algorithms.fedprox import FedProx  # noqa: E402

register_algorithm(FedProx)
from fedray.algorithms.dafkd import DaFKD  # noqa: E402
register_algorithm(DaFKD)
from fedray.algorithms.fedkf import FedKF  # noqa: E402

register_algorithm(FedKF)
from fedray.algorithms.qffl import QFFL  # noqa: E402

register_algorithm(QFFL)
from fedray.algorithms.fedgkd import FedGKD  # noqa: E402

register_algorithm(FedGKD)


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            "algorithm.name", f"unknown algorithm '{name}'; allowed: {', '.join(sorted(ALGORITHMS))}"
        ) from None


__all__ = ["ALGORITHMS", "Algorithm", "ClientContext", "ClientResult", "DataSpec", "ServerContext", "get_algorithm", "register_algorithm"]
