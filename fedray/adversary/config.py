"""``adversary.*``: which clients are malicious and what they do (docs/adversaries.md).

Kept apart from :mod:`fedray.config` (which includes it as ``ExperimentConfig.adversary``), as ``channel.*`` is, so
that the adversary's keys read in one place. The key names are a public contract: scripts and sweeps use them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fedray.errors import ConfigError, refuse_unread_keys

#: Where each attack acts: on the client's data, on what its client sends (the channel's adversary stage), or at
#: the server before aggregation (attacks that need other clients' updates: a colluding server-side stage).
DATA_ATTACKS = ("label_flip", "backdoor")
UPDATE_ATTACKS = ("sign_flip", "scale", "gaussian")
COLLUDING_ATTACKS = ("lie", "min_max")
MESSAGE_ATTACKS = ("inflate_count", "forge_logits", "forge_histogram")
ATTACKS = ("none", *DATA_ATTACKS, *UPDATE_ATTACKS, *COLLUDING_ATTACKS, *MESSAGE_ATTACKS)

#: The keys each attack reads; any other attack key set away from its default is refused (it would change nothing).
ATTACK_KEYS: dict[str, tuple[str, ...]] = {
    "none": (), "label_flip": ("flip", "flip_map"), "backdoor": ("target", "poison_fraction", "trigger_size"),
    "sign_flip": ("scale", "fields"), "scale": ("scale", "fields"), "gaussian": ("noise_std", "fields"),
    "lie": ("estimate", "lie_z", "fields"), "min_max": ("estimate", "perturbation", "fields"),
    "inflate_count": ("count_factor",), "forge_logits": ("target", "logit_margin", "fields"),
    "forge_histogram": ("target",),
}


class AdversaryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    attack: Literal[ATTACKS] = Field(  # type: ignore[valid-type]
        default="none", description="what the malicious clients do (docs/adversaries.md): label_flip / backdoor "
        "(their data); sign_flip / scale / gaussian (their model updates); lie / min_max (colluding, from updates "
        "they see: a server-side stage before aggregation); inflate_count (the sample count they report); "
        "forge_logits / forge_histogram (distillation messages)")
    fraction: float = Field(default=0.0, ge=0, le=1, description="the share of registered clients that are "
                            "malicious, round(fraction x data.num_clients) and at least one, drawn by the run's seed")
    clients: list[int] | None = Field(default=None, description="the malicious clients by id, instead of "
                                      "adversary.fraction")
    choose: Literal["random", "most_available"] = Field(
        default="random", description="adversary.fraction's clients: drawn by the run's seed, or the ones online "
        "longest over the first adversary.horizon_s simulated seconds under system.availability (ties: lower id)")
    horizon_s: float = Field(default=3600.0, gt=0, description="choose=most_available: the simulated seconds over "
                             "which the clients' online time is measured")
    # --- the attacks' parameters -----------------------------------------------------------------------------
    scale: float = Field(default=1.0, description="sign_flip: u -> -scale u; scale: u -> scale u (model "
                         "replacement: the clients of a round, Bagdasaryan et al. 2020); u the update against the "
                         "model the client was sent")
    noise_std: float = Field(default=1.0, gt=0, description="gaussian: the update replaced by N(0, noise_std^2 I) "
                             "(Blanchard et al. 2017's Gaussian Byzantine worker)")
    estimate: Literal["own", "omniscient"] = Field(
        default="own", description="lie / min_max: the benign updates' statistics from the malicious clients' own "
        "updates of the step (LIE's paper) or from every honest update of the step")
    lie_z: float | None = Field(default=None, description="lie: the deviations z below the mean; default the paper's "
                                "z_max for n uploads and m malicious among them")
    perturbation: Literal["unit_vec", "std", "sign"] = Field(
        default="std", description="min_max: the direction p of mu + gamma p (Shejwalkar and Houmansadr 2021): "
        "-mu/||mu||, -std, or -sign(mu)")
    count_factor: float = Field(default=10.0, gt=0, description="inflate_count: the sample count reported, times "
                                "the true one")
    target: int = Field(default=0, ge=0, description="backdoor / forge_logits / forge_histogram: the target class")
    logit_margin: float = Field(default=5.0, ge=0, description="forge_logits: the target's logit set to the row's "
                                "largest logit plus this margin")
    flip: Literal["reverse", "random", "map"] = Field(
        default="reverse", description="label_flip: y -> C - 1 - y; random: a seeded other label a sample; map: "
        "adversary.flip_map")
    flip_map: list[int] | None = Field(default=None, description="label_flip with flip=map: the label each class "
                                       "becomes (C entries)")
    poison_fraction: float = Field(default=0.5, gt=0, le=1, description="backdoor: the share of the client's "
                                   "samples stamped with the trigger and relabelled to adversary.target")
    trigger_size: int = Field(default=3, ge=1, description="backdoor: the side of the square trigger at the images' "
                              "bottom-right corner, a checkerboard of the brightest and darkest pixel values")
    fields: list[str] | None = Field(default=None, description="update and logit attacks: the upload fields forged "
                                     "(top-level names, e.g. [generator]); default every model field (updates) or "
                                     "every values field whose last dimension is the classes (forge_logits)")

    @property
    def enabled(self) -> bool:
        return self.attack != "none"

    def check(self, num_clients: int, num_classes: int | None = None,
              image_size: tuple[int, int] | None = None, availability: str | None = None) -> None:
        """The keys' agreement with each other and with the run (its classes, its images' (H, W) and
        ``system.availability`` when known); ConfigError naming the key."""
        default = AdversaryConfig()
        refuse_unread_keys(self, "adversary", "attack", ATTACK_KEYS)
        if not self.enabled:
            for key in ("fraction", "clients", "choose", "horizon_s"):
                if getattr(self, key) != getattr(default, key):
                    raise ConfigError(f"adversary.{key}", "needs an attack: set adversary.attack")
            return
        if self.clients is not None:
            if self.fraction != default.fraction or self.choose != default.choose:
                raise ConfigError("adversary.clients", "names the malicious clients itself: leave adversary.fraction "
                                  "and adversary.choose unset")
            bad = [c for c in self.clients if not 0 <= c < num_clients]
            if bad or not self.clients or len(set(self.clients)) != len(self.clients):
                raise ConfigError("adversary.clients", f"{self.clients} is not a list of distinct client ids; "
                                  f"allowed: 0..{num_clients - 1}")
        elif self.fraction == 0:
            raise ConfigError("adversary.fraction", f"no client is malicious under adversary.attack={self.attack}; set "
                              "adversary.fraction > 0 or adversary.clients")
        if self.choose == "most_available" and availability == "always":
            raise ConfigError("adversary.choose", "most_available ranks the clients by their online time, but "
                              "system.availability=always keeps every client online; set system.availability")
        if self.choose == "random" and self.horizon_s != default.horizon_s:
            raise ConfigError("adversary.horizon_s", "is only read with adversary.choose=most_available")
        if self.flip == "map" and self.flip_map is None:
            raise ConfigError("adversary.flip_map", "flip=map needs the map: one label per class")
        if self.flip_map is not None:
            if self.flip != "map":
                raise ConfigError("adversary.flip_map", "is only read with adversary.flip=map")
            if num_classes is not None and (len(self.flip_map) != num_classes
                                            or any(not 0 <= y < num_classes for y in self.flip_map)):
                raise ConfigError("adversary.flip_map", f"needs {num_classes} labels in 0..{num_classes - 1}, one per "
                                  "class")
        if num_classes is not None and self.target >= num_classes:
            raise ConfigError("adversary.target", f"{self.target} is not a class; allowed: 0..{num_classes - 1}")
        if image_size is not None and self.trigger_size > min(image_size):
            raise ConfigError("adversary.trigger_size", f"{self.trigger_size} does not fit the {image_size[0]}x"
                              f"{image_size[1]} images; allowed: 1..{min(image_size)}")
        if self.attack == "scale" and self.scale == default.scale:
            raise ConfigError("adversary.scale", "scale=1 sends the honest update; set the boost, e.g. the clients of a "
                              "round (model replacement)")


__all__ = ["ATTACKS", "ATTACK_KEYS", "AdversaryConfig", "COLLUDING_ATTACKS", "DATA_ATTACKS", "MESSAGE_ATTACKS",
           "UPDATE_ATTACKS"]
