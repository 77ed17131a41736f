"""``privacy.*``: client-level differential privacy of what the clients send (see :mod:`fedray.privacy`).

Kept apart from :mod:`fedray.config` (which includes it as ``ExperimentConfig.privacy``), as ``channel.*`` is, so that
the privacy keys read in one place. The key names are a public contract: scripts and sweeps use them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fedray.errors import ConfigError, refuse_unread_keys

#: The keys each mechanism reads; any other key set away from its default is refused (it would change nothing).
MECHANISM_KEYS: dict[str, tuple[str, ...]] = {
    "none": ("mia_samples",),
    "central": ("clip", "noise_multiplier", "delta", "accountant", "target_epsilon", "mia_samples"),
    "local": ("clip", "noise_multiplier", "delta", "accountant", "target_epsilon", "mia_samples"),
}


class PrivacyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mechanism: Literal["none", "central", "local"] = Field(
        default="none", description="client-level DP of every upload: none; central: each upload clipped to "
        "privacy.clip where the client runs, Gaussian noise of std noise_multiplier x clip added once at the server "
        "to the unweighted sum of the clipped updates, divided by the expected cohort (DP-FedAvg); local: each upload "
        "clipped and noised before it leaves its client")
    clip: float = Field(default=1.0, gt=0, description="C: the L2 norm each client's whole upload a round (its model "
                        "fields as updates from what it was sent, its values as they are) is clipped to")
    noise_multiplier: float | Literal["auto"] = Field(
        default=1.0, description="sigma: the Gaussian noise's std over the clip, >= 0; auto: the smallest sigma whose "
        "epsilon after federation.rounds rounds is within privacy.target_epsilon (dp-accounting's calibration)")
    delta: float = Field(default=1e-5, gt=0, lt=1, description="the delta epsilon is reported at")
    accountant: Literal["rdp", "pld"] = Field(
        default="rdp", description="dp-accounting's accountant: rdp (Renyi DP; uniform sampling without replacement "
        "amplifies), pld (privacy loss distributions; no amplification for a fixed-size cohort, which it does not "
        "model)")
    target_epsilon: float | None = Field(default=None, gt=0, description="the run stops, finished, before the round "
                                         "whose epsilon would pass it")
    mia_samples: int = Field(default=0, ge=0, description="the membership-inference audit (diag/mia_auc, with DP or "
                             "without): this many of the clients' training examples, a seeded sample, scored against "
                             "the global test set at every evaluation; 0: no audit")

    @property
    def enabled(self) -> bool:
        return self.mechanism != "none"

    def check(self, rule: str) -> None:
        """The keys' agreement with each other and with ``aggregation.rule`` (``rule``); ConfigError naming the key."""
        refuse_unread_keys(self, "privacy", "mechanism", MECHANISM_KEYS)
        if self.mechanism == "central" and rule != "mean":
            raise ConfigError("privacy.mechanism", f"central noise is the aggregation hook's rule, which "
                              f"aggregation.rule={rule} would replace; use aggregation.rule=mean, or "
                              "privacy.mechanism=local with the robust rule")
        if self.noise_multiplier != "auto" and self.noise_multiplier < 0:
            raise ConfigError("privacy.noise_multiplier", f"{self.noise_multiplier:g} is negative; allowed: >= 0, "
                              "or auto")
        if self.noise_multiplier == "auto" and self.target_epsilon is None:
            raise ConfigError("privacy.noise_multiplier", "auto derives sigma from privacy.target_epsilon and "
                              "federation.rounds: set privacy.target_epsilon")
        if self.enabled and self.noise_multiplier == 0 and self.target_epsilon is not None:
            raise ConfigError("privacy.target_epsilon", "without noise (privacy.noise_multiplier=0) epsilon is "
                              "infinite from the first round; set a noise multiplier > 0")
