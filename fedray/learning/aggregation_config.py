"""``aggregation.*``: the rule at the one aggregation hook (:mod:`fedray.learning.aggregation`,
:mod:`fedray.learning.robust`; docs/adversaries.md).

Kept apart from :mod:`fedray.config` (which includes it as ``ExperimentConfig.aggregation``), as ``channel.*`` is, so
that the rule's keys read in one place. The key names are a public contract: scripts and sweeps use them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fedray.errors import ConfigError, refuse_unread_keys

#: The keys each rule reads; any other key set away from its default is refused (it would change nothing).
RULE_KEYS: dict[str, tuple[str, ...]] = {
    "mean": (), "median": (), "trimmed_mean": ("beta",), "krum": ("f",), "multi_krum": ("f", "m"),
    "norm_bound": ("max_norm",), "fltrust": (),
}


class AggregationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rule: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum", "norm_bound", "fltrust"] = Field(
        default="mean", description="mean: the weighted mean; median / trimmed_mean: coordinate-wise (Yin et al. "
        "2018); krum / multi_krum (Blanchard et al. 2017); norm_bound: updates clipped, then the mean (Sun et al. "
        "2019); fltrust: updates weighed by their trust against the server's own update on its labelled "
        "data.server_data (Cao et al. 2021)")
    beta: float = Field(default=0.1, ge=0, description="trimmed_mean: the fraction of values dropped at each end of "
                        "every coordinate, in [0, 0.5)")
    f: int = Field(default=1, ge=0, description="krum / multi_krum: the adversaries tolerated; 2f + 2 < the uploads "
                   "of a server step")
    m: int = Field(default=1, ge=1, description="multi_krum: the uploads of least Krum score averaged")
    max_norm: float | None = Field(default=None, gt=0, description="norm_bound: the L2 norm each client's update "
                                   "is clipped to (required)")

    def check(self, uploads: int, server_data: Any) -> None:
        """The keys' agreement with each other, with ``uploads``, the uploads of one server step
        (``federation.clients_per_round``, or ``federation.buffer_size`` asynchronously), and with ``server_data``
        (``data.server_data``: FLTrust's root dataset); ConfigError naming the key."""
        refuse_unread_keys(self, "aggregation", "rule", RULE_KEYS)
        if self.rule == "trimmed_mean" and self.beta >= 0.5:
            raise ConfigError("aggregation.beta", f"{self.beta:g} would trim every value; allowed: 0 <= beta < 0.5")
        if self.rule in ("krum", "multi_krum") and 2 * self.f + 2 >= uploads:
            raise ConfigError("aggregation.f", f"{self.f} adversaries among {uploads} uploads a step: Krum needs 2f + "
                              f"2 < n; allowed: 0..{max((uploads - 3) // 2, 0)}, or more clients a round")
        if self.rule == "multi_krum" and self.m > uploads:
            raise ConfigError("aggregation.m", f"{self.m} exceeds the {uploads} uploads of a step; allowed: "
                              f"1..{uploads}")
        if self.rule == "norm_bound" and self.max_norm is None:
            raise ConfigError("aggregation.max_norm", "norm_bound needs the bound: set aggregation.max_norm > 0")
        if self.rule == "fltrust":  # the server trains g_0 on its root data with labels, as a client trains
            if server_data.kind == "none":
                raise ConfigError("data.server_data.kind", "aggregation.rule=fltrust trains the server's own update on "
                                  "a labelled root dataset it holds: set data.server_data.kind=holdout (the paper's "
                                  "100 root examples on 10 classes: data.server_data.per_class=10)")
            if not server_data.is_labelled():
                raise ConfigError("data.server_data.labelled", "aggregation.rule=fltrust trains the server's own "
                                  "update on its data, so it needs its labels: set data.server_data.labelled=true")


__all__ = ["AggregationConfig", "RULE_KEYS"]
