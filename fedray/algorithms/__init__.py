"""Federated methods, one module each, found by ``algorithm.name``."""

from __future__ import annotations

from fedray.algorithms.base import Algorithm, ClientContext, ClientResult, DataSpec, ServerContext
from fedray.algorithms.fedavg import FedAvg
from fedray.algorithms.fedprox import FedProx
from fedray.errors import ConfigError

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FedAvg, FedProx)}


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            "algorithm.name", f"unknown algorithm '{name}'; allowed: {', '.join(sorted(ALGORITHMS))}"
        ) from None


__all__ = ["ALGORITHMS", "Algorithm", "ClientContext", "ClientResult", "DataSpec", "ServerContext", "get_algorithm"]
