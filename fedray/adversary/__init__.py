"""Malicious clients (``adversary.*``; docs/adversaries.md).

Which clients are malicious is a function of the config alone (:func:`malicious_clients`), so the driver, every
worker and the server agree on it without being told. What they do acts where the client runs: on its data
(:mod:`fedray.adversary.data`), on what it sends (the channel's adversary stage, :mod:`fedray.adversary.forge`), or,
for attacks that need other clients' updates, at the server before aggregation (:mod:`fedray.adversary.collude`).
Knows no method and no Ray.
"""

from __future__ import annotations

import numpy as np

from fedray.adversary.config import AdversaryConfig
from fedray.seeding import derive_seed


def malicious_clients(cfg) -> frozenset[int]:
    """The malicious clients of ``cfg`` (an ExperimentConfig): ``adversary.clients``, or round(fraction x
    data.num_clients) of them (at least one): drawn without replacement by the run's seed, or (``choose=
    most_available``) those online longest over the first ``adversary.horizon_s`` of the run's availability process;
    none without an attack."""
    adv, n = cfg.adversary, cfg.data.num_clients
    if not adv.enabled:
        return frozenset()
    if adv.clients is not None:
        return frozenset(adv.clients)
    k = min(n, max(1, round(adv.fraction * n)))
    if adv.choose == "most_available":  # the clients a real attacker would pick: those that take part most
        from fedray.system.clock import online_seconds

        online = online_seconds(cfg.system, n, cfg.seed, adv.horizon_s)
        return frozenset(int(c) for c in np.lexsort((np.arange(n), -online))[:k])
    rng = np.random.default_rng(derive_seed(cfg.seed, "adversary"))
    return frozenset(int(c) for c in rng.choice(n, size=k, replace=False))


__all__ = ["AdversaryConfig", "malicious_clients"]
