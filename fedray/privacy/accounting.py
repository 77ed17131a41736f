"""Epsilon of a run's client-level DP after each server step, from Google's ``dp-accounting`` (never by hand).

One server step is one release of the Gaussian mechanism on the sum of the clipped uploads: the event is a function
of the config alone, so epsilon after t steps is a pure function of (config, t), the same in process, on Ray and after
a resume, with no accountant state to checkpoint.

- ``privacy.mechanism=central``, synchronous, no simulated system: the cohort is a fixed number m of the n registered
  clients drawn uniformly without replacement (fedray.seeding.sample_clients), which is what the RDP accountant's
  ``SampledWithoutReplacementDpEvent`` models (Wang, Balle and Kasiviswanathan, AISTATS 2019, Theorem 27), under its
  neighbouring relation: replace one client (n public). Replacing one client moves the sum of clipped updates by up
  to 2C, so the event's Gaussian has noise multiplier sigma / 2 (its sensitivity 1 is the replace-one 2C).
- Otherwise no amplification by sampling: the cohort is not that draw (availability, deadlines and over-commitment
  decide who arrives; FedBuff's buffer takes whoever finishes first), the PLD accountant here models no fixed-size
  cohort, or the noise is local (each client's message is seen on its own). Each step is then the plain Gaussian
  mechanism composed: central, add or remove one client (sensitivity C: noise multiplier sigma); local, replace one
  client's data (its clipped message moves by up to 2C: sigma / 2), for a client that took part in every step so
  far (an upper bound for each client). :func:`amplification` says which, in one line, and the run logs it.
"""

from __future__ import annotations

import functools
import math
from typing import Any


def amplification(cfg: Any) -> tuple[bool, str]:
    """(whether the accountant amplifies by sampling, the one line saying what it assumes) for ``cfg`` (an
    ExperimentConfig with privacy on)."""
    p, fed = cfg.privacy, cfg.federation
    if p.mechanism == "local":
        return False, ("local noise: each client's message is released on its own, no amplification by sampling; "
                       "epsilon of a client taking part in every step (replace-one, sensitivity 2C)")
    if fed.mode != "sync":
        return False, f"federation.mode={fed.mode}: who fills a step is not a uniform draw, no amplification"
    if cfg.system.enabled:
        return False, ("the simulated system decides who arrives (availability, deadlines, over-commitment): not a "
                       "uniform draw, no amplification")
    if p.accountant == "pld":
        return False, "privacy.accountant=pld models no fixed-size cohort: no amplification (use rdp for it)"
    if fed.clients_per_round == cfg.data.num_clients:
        return False, "every client takes part every round: nothing to amplify"
    return True, (f"a cohort of {fed.clients_per_round} of {cfg.data.num_clients} clients drawn uniformly without "
                  "replacement (RDP, replace-one relation, sensitivity 2C)")


def epsilon(cfg: Any, steps: int) -> float:
    """Epsilon at ``privacy.delta`` after ``steps`` server steps (0 steps: 0; no noise: inf)."""
    if steps <= 0:
        return 0.0
    if cfg.privacy.noise_multiplier == 0:
        return math.inf
    return _epsilon(_key(cfg), steps)


def _key(cfg: Any) -> tuple:
    p = cfg.privacy
    return (p.mechanism, p.noise_multiplier, p.delta, p.accountant, amplification(cfg)[0], cfg.data.num_clients,
            cfg.federation.clients_per_round)


@functools.lru_cache(maxsize=4096)
def _epsilon(key: tuple, steps: int) -> float:
    from dp_accounting import NeighboringRelation, dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    mechanism, sigma, delta, accountant, amplified, n, m = key
    if amplified:
        event = dp_event.SampledWithoutReplacementDpEvent(n, m, dp_event.GaussianDpEvent(sigma / 2))
    else:
        event = dp_event.GaussianDpEvent(sigma / 2 if mechanism == "local" else sigma)
    if accountant == "pld":
        acc = pld_privacy_accountant.PLDAccountant()
    else:
        relation = NeighboringRelation.REPLACE_ONE if amplified else NeighboringRelation.ADD_OR_REMOVE_ONE
        acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    acc.compose(dp_event.SelfComposedDpEvent(event, steps))
    return float(acc.get_epsilon(delta))


def last_round(cfg: Any) -> int:
    """The last round whose epsilon is within ``privacy.target_epsilon`` (``federation.rounds`` without a target); 0
    when even the first would pass it."""
    p, rounds = cfg.privacy, cfg.federation.rounds
    if p.target_epsilon is None:
        return rounds
    lo, hi = 0, rounds  # epsilon grows with the steps: the last t with epsilon(t) <= target, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if epsilon(cfg, mid) <= p.target_epsilon:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_budget(cfg: Any) -> None:
    """ConfigError naming ``privacy.target_epsilon`` when not even one round fits in it (before any work)."""
    from fedray.errors import ConfigError

    if cfg.privacy.target_epsilon is not None and last_round(cfg) == 0:
        raise ConfigError("privacy.target_epsilon", f"{cfg.privacy.target_epsilon:g} is passed by the first round "
                          f"already (epsilon {epsilon(cfg, 1):.3g} at delta {cfg.privacy.delta:g}); raise it or "
                          "privacy.noise_multiplier")


__all__ = ["amplification", "check_budget", "epsilon", "last_round"]
