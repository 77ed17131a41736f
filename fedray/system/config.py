"""``system.*``: the simulated devices, networks and availability (see :mod:`fedray.system`).

Kept apart from :mod:`fedray.config` (which includes it as ``ExperimentConfig.system``) so that the system model's
keys and their checks read in one place. The key names are a public contract: scripts and sweeps use them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fedray.errors import ConfigError
from fedray.paths import absolute_path
from fedray.system.oort import OortConfig

#: Keys that only mean something on a simulated clock (``system.devices`` other than none).
TIMED_KEYS = ("availability", "overcommit", "deadline_s", "server_sps", "speed_sigma", "selection")


class SystemConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    devices: Literal["none", "uniform", "heterogeneous", "trace", "fedscale"] = Field(
        default="none", description="none: no simulated time, every figure as without a system model; uniform: "
        "every client gets compute_sps, up_mbps, down_mbps and latency_ms; heterogeneous: seeded draws per client "
        "from the built-in distributions of docs/system.md; trace: one row per client from system.trace; fedscale: "
        "system.trace is FedScale's device capacity pickle, profiles assigned as FedScale does (docs/system.md)")
    compute_sps: float = Field(default=100.0, gt=0, description="uniform: training samples a client passes through "
                               "its models per second")
    up_mbps: float = Field(default=10.0, gt=0, description="uniform: upload bandwidth, Mbit/s")
    down_mbps: float = Field(default=40.0, gt=0, description="uniform: download bandwidth, Mbit/s")
    latency_ms: float = Field(default=50.0, ge=0, description="uniform: one-way latency, paid once down and once up")
    trace: str | None = Field(default=None, description="devices=trace: a CSV or parquet file with columns client, "
                              "compute_sps, up_mbps, down_mbps, latency_ms (one row per client id); devices=fedscale: "
                              "FedScale's client_device_capacity pickle")
    availability: Literal["always", "markov", "trace", "fedscale"] = Field(
        default="always", description="always: every client is online; markov: online and offline periods of "
        "exponential length (means mean_online_s, mean_offline_s), seeded; trace: the online intervals of "
        "system.availability_trace; fedscale: system.availability_trace is FedScale's client_behave_trace pickle, "
        "each client's intervals repeating with its entry's finish_time")
    mean_online_s: float = Field(default=1350.0, gt=0, description="markov: mean length of an online period, s "
                                 "(default: FLASH's per-phone median, 22.5 min)")
    mean_offline_s: float = Field(default=12960.0, gt=0, description="markov: mean length of an offline period, s "
                                  "(default: FLASH's per-phone median, 3.6 h)")
    availability_trace: str | None = Field(default=None, description="availability=trace: a CSV or parquet file "
                                           "with columns client, start_s, end_s (the intervals a client is online); "
                                           "availability=fedscale: FedScale's client_behave_trace pickle")
    availability_cycle_s: float | None = Field(default=None, gt=0, description="availability=trace: the trace "
                                               "repeats with this period, s (its intervals lie within [0, it]); "
                                               "none: after its last interval a client stays offline")
    overcommit: float = Field(default=1.0, ge=1, description="select ceil(clients_per_round x overcommit) online "
                              "clients and aggregate the first clients_per_round to finish (FedScale's 1.3)")
    deadline_s: float | None = Field(default=None, gt=0, description="a selected client that has not finished this "
                                     "many simulated seconds after the round's start is dropped")
    server_sps: float | None = Field(default=None, gt=0, description="the server's samples per second for its own "
                                     "work (distillation, generator training); none: the server takes no time")
    speed_sigma: float = Field(default=0.0, ge=0, le=3, description="speeds that vary: each round a client's compute "
                               "and network speeds are its device's times exp(sigma z), z standard normal drawn per "
                               "run, round, client and quantity (lognormal, median the device's); 0: fixed speeds")
    selection: Literal["uniform", "oort"] = Field(default="uniform", description="how a synchronous round picks its "
                                                  "clients among those online: uniform (seeded), or oort (Lai et al., "
                                                  "OSDI 2021: by reported loss and measured duration, system.oort.*)")
    oort: OortConfig = Field(default_factory=OortConfig, description="system.selection=oort: its knobs")

    @field_validator("trace", "availability_trace")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        return None if path is None else str(absolute_path(path))

    @property
    def enabled(self) -> bool:
        return self.devices != "none"

    def check(self) -> None:
        """The keys' agreement with each other (the trace files are read by :func:`fedray.system.check_traces`)."""
        if self.devices == "fedscale" and self.trace is None:
            raise ConfigError("system.trace", "system.devices=fedscale needs a file; give system.trace=PATH "
                              "(FedScale's client_device_capacity pickle, docs/system.md#fedscales-traces)")
        if self.devices == "trace" and self.trace is None:
            raise ConfigError("system.trace", "system.devices=trace needs a file; give system.trace=PATH (CSV or "
                              "parquet with columns client, compute_sps, up_mbps, down_mbps, latency_ms)")
        if self.devices not in ("trace", "fedscale") and self.trace is not None:
            raise ConfigError("system.trace", f"is only read with system.devices=trace or fedscale (it is "
                              f"{self.devices})")
        if self.availability == "fedscale" and self.availability_trace is None:
            raise ConfigError("system.availability_trace", "system.availability=fedscale needs a file; give "
                              "system.availability_trace=PATH (FedScale's client_behave_trace pickle, "
                              "docs/system.md#fedscales-traces)")
        if self.availability == "trace" and self.availability_trace is None:
            raise ConfigError("system.availability_trace", "system.availability=trace needs a file; give "
                              "system.availability_trace=PATH (CSV or parquet with columns client, start_s, end_s)")
        if self.availability not in ("trace", "fedscale") and self.availability_trace is not None:
            raise ConfigError("system.availability_trace", "is only read with system.availability=trace or fedscale "
                              f"(it is {self.availability})")
        if self.selection != "oort" and self.oort != OortConfig():
            changed = next(k for k in OortConfig.model_fields if getattr(self.oort, k) != getattr(OortConfig(), k))
            raise ConfigError(f"system.oort.{changed}", f"is only read with system.selection=oort (it is "
                              f"{self.selection})")
        if self.availability_cycle_s is not None and self.availability != "trace":
            raise ConfigError("system.availability_cycle_s", "repeats the intervals of system.availability=trace (it "
                              f"is {self.availability}); FedScale's traces give each client's period themselves")
        if not self.enabled:
            default = SystemConfig()
            for key in TIMED_KEYS:
                if getattr(self, key) != getattr(default, key):
                    raise ConfigError(f"system.{key}", "needs a simulated clock; set system.devices to uniform, "
                                      "heterogeneous, trace or fedscale")
