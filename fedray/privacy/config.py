"""``privacy.*``: client-level differential privacy of what the clients send (see :mod:`fedray.privacy`).

Kept apart from :mod:`fedray.config` (which includes it as ``ExperimentConfig.privacy``), as ``channel.*`` is, so that
the privacy keys read in one place. The key names are a public contract: scripts and sweeps use them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fedray.errors import ConfigError, refuse_unread_keys

#: The keys each mechanism reads; any other key set away from its default is refused (it would change nothing).
SAMPLE_KEYS = ("sample_clip", "sample_noise", "sample_batches", "mia_samples")  # read whatever the mechanism
MECHANISM_KEYS: dict[str, tuple[str, ...]] = {
    "none": ("delta", *SAMPLE_KEYS),
    "central": ("clip", "noise_multiplier", "delta", "accountant", "target_epsilon", "mia_samples", "adaptive_clip",
                "target_quantile", "clip_lr", "count_noise", "sample_clip", "sample_noise", "sample_batches"),
    "local": ("clip", "noise_multiplier", "delta", "accountant", "target_epsilon", "mia_samples", "sample_clip",
              "sample_noise", "sample_batches", "histogram_clip", "histogram_noise"),
}


#: The adaptive clip's own keys (read only with ``adaptive_clip``).
ADAPTIVE_KEYS = ("target_quantile", "clip_lr", "count_noise")


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
    adaptive_clip: bool = Field(default=False, description="central only: the clip follows a quantile of the "
                                "clients' update norms (Andrew et al. 2021), privacy.clip its start; the count of "
                                "clients within the clip is noised and its noise accounted")
    target_quantile: float = Field(default=0.5, gt=0, lt=1, description="adaptive_clip: gamma, the quantile of the "
                                   "update norms the clip follows")
    clip_lr: float = Field(default=0.2, gt=0, description="adaptive_clip: eta, the geometric step of the clip a round")
    count_noise: float | None = Field(default=None, gt=0, description="adaptive_clip: sigma_b, the std of the noise "
                                      "on the count of clients within the clip; null: the expected uploads / 20 "
                                      "(Andrew et al.)")
    histogram_clip: float = Field(default=1000.0, gt=0, description="local: the L2 norm a client's label histograms "
                                  "of a round (all of its upload's, as one vector) are scaled to at most before "
                                  "their noise (proportions kept)")
    histogram_noise: float | None = Field(default=None, gt=0, description="local: sigma_k, the label histograms' "
                                          "noise std over histogram_clip, for methods that upload them; null: twice "
                                          "the noise multiplier. The updates' multiplier is lowered so that the "
                                          "accountant's covers both")
    sample_clip: float | None = Field(default=None, gt=0, description="sample-level DP of the clients' local "
                                      "training (DP-SGD): each example's gradient clipped to this L2 norm; null: off")
    sample_noise: float = Field(default=1.0, ge=0, description="sample_clip: sigma_s, DP-SGD's noise std over the "
                                "example clip")
    sample_batches: Literal["passes", "poisson"] = Field(
        default="passes", description="sample_clip: the local batches: passes (reshuffled passes over the client's "
        "data, no amplification claimed) or poisson (each step every example with probability batch_size / n, "
        "the sum over the expected size; accounted with amplification by sampling)")
    mia_samples: int = Field(default=0, ge=0, description="the membership-inference audit (diag/mia_auc, with DP or "
                             "without): this many of the clients' training examples, a seeded sample, scored against "
                             "the global test set at every evaluation (personalised methods: each client's own "
                             "model on its own members, pooled); 0: no audit")

    @property
    def enabled(self) -> bool:
        return self.mechanism != "none"

    def check(self, rule: str, mode: str = "sync") -> None:
        """The keys' agreement with each other, with ``aggregation.rule`` (``rule``) and ``federation.mode``
        (``mode``); ConfigError naming the key."""
        refuse_unread_keys(self, "privacy", "mechanism", MECHANISM_KEYS)
        default = PrivacyConfig()
        for key in ("sample_noise", "sample_batches"):
            if self.sample_clip is None and getattr(self, key) != getattr(default, key):
                raise ConfigError(f"privacy.{key}", "is only read with privacy.sample_clip set (DP-SGD)")
        for key in ADAPTIVE_KEYS:
            if not self.adaptive_clip and getattr(self, key) != getattr(default, key):
                raise ConfigError(f"privacy.{key}", "is only read with privacy.adaptive_clip=true")
        if self.adaptive_clip and mode != "sync":
            raise ConfigError("privacy.adaptive_clip", f"with federation.mode={mode} a step's uploads were clipped at "
                              "the clips of older payloads, above the one the noise is scaled to; use mode=sync")
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
