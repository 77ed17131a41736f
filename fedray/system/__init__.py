"""The simulated system: devices, networks and availability on a virtual clock, and the schedules that drive a run's
work through the one round protocol (:mod:`.protocol`; arrays, seeded; knows no method and no Ray).
``system.devices=none`` (the default) leaves the clock out: no simulated time, figures as without it."""

from fedray.system.clock import SystemClock
from fedray.system.config import SystemConfig
from fedray.system.protocol import Report, Schedule, Step, Work, build_schedule, register_schedule

__all__ = ["Report", "Schedule", "Step", "SystemClock", "SystemConfig", "Work", "build_schedule", "check_traces",
           "register_schedule"]


def check_traces(cfg: SystemConfig, num_clients: int) -> None:
    """Read and check the trace files ``cfg`` names, for ``num_clients`` registered clients (ConfigError if bad)."""
    from fedray.system.fedscale import read_fedscale_behaviour, read_fedscale_devices
    from fedray.system.traces import read_availability_trace, read_device_trace

    if cfg.devices == "trace":
        read_device_trace("system.trace", cfg.trace, num_clients)
    if cfg.devices == "fedscale":
        read_fedscale_devices("system.trace", cfg.trace, num_clients)
    if cfg.availability == "trace":
        read_availability_trace("system.availability_trace", cfg.availability_trace, num_clients,
                                cfg.availability_cycle_s)
    if cfg.availability == "fedscale":
        read_fedscale_behaviour("system.availability_trace", cfg.availability_trace, num_clients)
