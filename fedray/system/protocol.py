"""The one round protocol: what a schedule asks of the runtime, and what a schedule is.

To the runtime a synchronous round and an asynchronous step are the same work (:class:`Work`): start clients'
training from a model version, take their results, drop some, and take one server step over a set of results with
their versions and weights. A schedule (:class:`Schedule`) decides whom to start, which results arrive and when the
step happens, keeps the simulated clock if there is one, and returns the step's figures (:class:`Report`, with its
``sim/*`` row). The round loop calls ``schedule.step(round, runtime)`` once a round and never branches on the
schedule's type nor touches the clock.

Versions count server steps: the model after ``v`` steps is version ``v``, and its payload is the method's
broadcast for round ``v + 1``. A synchronous round ``r`` starts every client from version ``r - 1`` and steps over
fresh results with the method's own weights (``weights=None``); FedBuff starts clients from the version current at
their dispatch and steps over results of older versions with staleness weights, each rebased by the method
(:meth:`fedray.methods.api.Algorithm.rebase`).

A new schedule is one file subclassing :class:`Schedule` and one line in :data:`SCHEDULES` (or
:func:`register_schedule` from a user's script); ``federation.mode`` names it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from fedray.errors import ConfigError


@dataclass
class Step:
    """One server step, as the runtime ran it."""

    infos: list[dict]  # the aggregated clients' infos, in client-id order (their figures, bytes_up, work_samples)
    metrics: dict[str, float]  # the server's metrics (``server/*``, ``diag/*``, ``health/*``, ``sim/server_samples``)
    wall_s: float = 0.0  # the server step's wall time, as the driver waited for it


@dataclass
class Report:
    """What a schedule's step gives the loop: the server step, the bytes sent down to the clients it started, and
    the simulated system's ``sim/*`` figures of the step (empty without a system)."""

    step: Step
    bytes_down: float
    sim: dict[str, float] = field(default_factory=dict)
    #: the step's rows of ``events.parquet`` (columns of equal length, :func:`fedray.system.clock.events`); None
    #: without a simulated system
    events: dict[str, Any] | None = None


class Work(Protocol):
    """What a schedule asks of the runtime (:class:`fedray.runtime.base.Runtime` implements it). One piece of work
    per client at a time; results are taken in the order the schedule asks, never in the order they finish."""

    def start(self, round_: int, client_ids: list[int], version: int) -> list[int]:
        """Start the training of ``client_ids`` (sorted) from the payload of model ``version``; ``round_`` is the
        round their context gets. Returns the bytes sent down to each (after the channel's stages)."""

    def results(self, client_ids: list[int]) -> list[dict | None]:
        """The info of each started client's work (waits for it): ``work_samples``, ``bytes_up`` (after the
        channel's stages), ``num_samples`` and its figures; None for a client whose work was lost (its worker
        failed past ``runtime.max_client_retries``, or it passed ``runtime.client_timeout_s``)."""

    def drop(self, client_ids: list[int]) -> None:
        """Forget the work of ``client_ids``: their uploads and new states are lost (a dropout, a straggler)."""

    def step(self, round_: int, client_ids: list[int], versions: list[int],
             weights: list[float] | None) -> Step:
        """One server step over the uploads of ``client_ids`` (client-id order), trained from ``versions``;
        ``weights``: None for the method's own weighting of fresh uploads, else each upload is rebased onto the
        current model with its change weighted (FedBuff's staleness). Those clients keep their new state. No
        clients: the server state stays as it is."""


class Schedule(ABC):
    """Whom to start, which results arrive, when the server steps; the simulated clock when there is one.

    ``stale``: True when a step takes uploads trained from older versions (the method must declare asynchronous
    support, with a correct ``rebase``). A schedule's state (:meth:`state`) goes into the checkpoint; after
    :meth:`load` the loop calls :meth:`restart` so that work in flight at the checkpoint runs again."""

    name: ClassVar[str]
    stale: ClassVar[bool] = False

    @classmethod
    def check(cls, cfg: Any) -> None:
        """The config's agreement with this schedule (``cfg``: the ExperimentConfig); ConfigError naming the key.
        Default: the asynchronous keys are refused."""
        fed = cfg.federation
        for key in ("concurrency", "buffer_size"):
            if getattr(fed, key) is not None:
                raise ConfigError(f"federation.{key}", "is only read with federation.mode=async")
        if fed.staleness != "none":
            raise ConfigError("federation.staleness", "is only read with federation.mode=async")

    @classmethod
    @abstractmethod
    def build(cls, cfg: Any, num_clients: int) -> "Schedule":
        """This run's schedule (``cfg``: the ExperimentConfig, checked)."""

    @abstractmethod
    def step(self, round_: int, work: Work) -> Report:
        """Round ``round_``: one server step, its work run through ``work``."""

    def register(self, sizes: np.ndarray) -> None:
        """The clients' training-set sizes (index = client id), as clients declare them when they register, before
        the first round (Oort ranks the clients it has not heard from by them). Default: not read."""

    def client_columns(self, client_ids: np.ndarray | list[int]) -> dict[str, np.ndarray]:
        """Per-client columns of ``clients.parquet`` the schedule keeps (the clock's rounds and busy time)."""
        return {}

    def state(self) -> Any:
        """Its state for a checkpoint (None: nothing to keep)."""
        return None

    def load(self, state: Any) -> None:
        """Continue from a checkpoint's :meth:`state`."""

    def restart(self, work: Work) -> None:
        """After :meth:`load`: start again the work that was in flight at the checkpoint."""


#: ``federation.mode`` -> the schedule's class, "module:Class", imported when first used.
SCHEDULES: dict[str, Any] = {
    "sync": "fedray.system.rounds:Rounds",
    "async": "fedray.system.fedbuff:FedBuff",
}


def register_schedule(cls: type[Schedule]) -> type[Schedule]:
    """Make ``federation.mode=<cls.name>`` run ``cls`` (usable as a decorator). The schedule runs in the driver,
    so a schedule defined in a user's script works on Ray unchanged."""
    existing = SCHEDULES.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"schedule name '{cls.name}' is already taken")
    SCHEDULES[cls.name] = cls
    return cls


def schedule_class(mode: str) -> type[Schedule]:
    """The schedule ``federation.mode`` names; ConfigError naming the modes allowed."""
    if mode not in SCHEDULES:
        raise ConfigError("federation.mode", f"unknown mode {mode!r}; allowed: {', '.join(SCHEDULES)}")
    entry = SCHEDULES[mode]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = SCHEDULES[mode] = getattr(importlib.import_module(module), attr)
    return entry


def build_schedule(cfg: Any, num_clients: int) -> Schedule:
    """The schedule of this run's ``federation.mode``."""
    return schedule_class(cfg.federation.mode).build(cfg, num_clients)


__all__ = ["Report", "SCHEDULES", "Schedule", "Step", "Work", "build_schedule", "register_schedule",
           "schedule_class"]
