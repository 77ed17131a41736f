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


def noise_multiplier(cfg: Any) -> float:
    """sigma: ``privacy.noise_multiplier``, or with ``auto`` the smallest that keeps epsilon after
    ``federation.rounds`` steps within ``privacy.target_epsilon`` (dp-accounting's ``calibrate_dp_mechanism``)."""
    p = cfg.privacy
    if p.noise_multiplier != "auto":
        return float(p.noise_multiplier)
    return _calibrated(_key(cfg, math.nan), cfg.federation.rounds, float(p.target_epsilon))


def count_noise(cfg: Any) -> float:
    """sigma_b of the adaptive clip's count: ``privacy.count_noise``, or the expected uploads of a step / 20."""
    p = cfg.privacy
    return float(p.count_noise) if p.count_noise is not None else cfg.federation.buffer() / 20


def histogram_noise(cfg: Any) -> float:
    """sigma_k of the label histograms under local noise: ``privacy.histogram_noise``, or twice the multiplier."""
    p = cfg.privacy
    return float(p.histogram_noise) if p.histogram_noise is not None else 2 * noise_multiplier(cfg)


def update_noise_multiplier(cfg: Any, histograms: bool = False) -> float:
    """The noise multiplier of the model updates (their sum, or each under local noise). With the adaptive clip its
    count is a second Gaussian query on the same clients (sensitivity 1/2, noise sigma_b); the two together are one
    Gaussian mechanism of multiplier z when the update's is z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) (Andrew et al.
    2021, Thm. 1), so the accountant's z (``privacy.noise_multiplier``) covers both. ConfigError naming
    ``privacy.count_noise`` when 2 sigma_b <= z (no z_Delta exists). Likewise under local noise a method that uploads
    label histogram(s) (``histograms``: :meth:`~fedray.methods.api.Algorithm.uploads_label_counts`) sends them as a
    second Gaussian release of multiplier sigma_k (:func:`histogram_noise`): z_Delta = (z^-2 - sigma_k^-2)^(-1/2)."""
    from fedray.errors import ConfigError

    z = noise_multiplier(cfg)
    if z == 0:
        return z
    if histograms and cfg.privacy.mechanism == "local":
        sk = histogram_noise(cfg)
        if sk <= z:
            raise ConfigError("privacy.histogram_noise", f"sigma_k = {sk:g} leaves no noise for the updates at "
                              f"noise_multiplier {z:.4g}: it needs sigma_k > z; raise privacy.histogram_noise")
        return (z ** -2 - sk ** -2) ** -0.5
    if not cfg.privacy.adaptive_clip:
        return z
    sb = count_noise(cfg)
    if 2 * sb <= z:
        raise ConfigError("privacy.count_noise", f"sigma_b = {sb:g} leaves no noise for the updates at "
                          f"noise_multiplier {z:.4g}: it needs 2 sigma_b > z; raise privacy.count_noise")
    return (z ** -2 - (2 * sb) ** -2) ** -0.5


def epsilon(cfg: Any, steps: int) -> float:
    """Epsilon at ``privacy.delta`` after ``steps`` server steps (0 steps: 0; no noise: inf)."""
    sigma = noise_multiplier(cfg)
    if steps <= 0:
        return 0.0
    if sigma == 0:
        return math.inf
    return _epsilon(_key(cfg, sigma), steps)


def _key(cfg: Any, sigma: float) -> tuple:
    p = cfg.privacy
    return (p.mechanism, sigma, p.delta, p.accountant, amplification(cfg)[0], cfg.data.num_clients,
            cfg.federation.clients_per_round)


def _event(key: tuple, sigma: float, steps: int):
    """A run of ``steps`` server steps at noise multiplier ``sigma`` as a dp-accounting event (module docstring)."""
    from dp_accounting import dp_event

    mechanism, _, _, _, amplified, n, m = key
    if amplified:
        event = dp_event.SampledWithoutReplacementDpEvent(n, m, dp_event.GaussianDpEvent(sigma / 2))
    else:
        event = dp_event.GaussianDpEvent(sigma / 2 if mechanism == "local" else sigma)
    return dp_event.SelfComposedDpEvent(event, steps)


def _accountant(key: tuple):
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    _, _, _, accountant, amplified, _, _ = key
    if accountant == "pld":
        return pld_privacy_accountant.PLDAccountant()
    relation = NeighboringRelation.REPLACE_ONE if amplified else NeighboringRelation.ADD_OR_REMOVE_ONE
    return rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)


@functools.lru_cache(maxsize=4096)
def _epsilon(key: tuple, steps: int) -> float:
    acc = _accountant(key)
    acc.compose(_event(key, key[1], steps))
    return float(acc.get_epsilon(key[2]))


@functools.lru_cache(maxsize=64)
def _calibrated(key: tuple, steps: int, target: float) -> float:
    from dp_accounting import calibrate_dp_mechanism
    from dp_accounting.mechanism_calibration import LowerEndpointAndGuess

    # searched up from a small positive sigma: at 0 the Gaussian's RDP divides by zero
    return float(calibrate_dp_mechanism(lambda: _accountant(key), lambda sigma: _event(key, sigma, steps), target,
                                        key[2], bracket_interval=LowerEndpointAndGuess(1e-3, 1.0), tol=1e-4))


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


__all__ = ["amplification", "check_budget", "count_noise", "epsilon", "last_round", "noise_multiplier",
           "histogram_noise", "update_noise_multiplier"]
