"""Synchronous rounds: every round starts its clients from the current model and the server steps over the fresh
uploads that arrive, with the method's own weights.

- :class:`Rounds` (no simulated system, ``system.devices=none``): ``federation.clients_per_round`` clients drawn
  uniformly (seeded by run seed and round), every upload arrives.
- :class:`ClockRounds` (a simulated system): the clients are drawn from those online, over-committed, and the
  virtual clock (:class:`~fedray.system.clock.SystemClock`) decides whose upload arrives (deadline, dropouts,
  stragglers) and how long the round takes; the step's ``sim/*`` row is the clock's.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fedray.errors import RunFailure
from fedray.seeding import sample_clients
from fedray.system.clock import SystemClock
from fedray.system.oort import UTILITY
from fedray.system.protocol import Report, Schedule, Step, Work


class Rounds(Schedule):
    """Today's rounds without a system; :meth:`build` gives :class:`ClockRounds` when ``system.devices`` is set."""

    name = "sync"

    def __init__(self, cfg: Any, num_clients: int):
        self.seed, self.num_clients, self.per_round = cfg.seed, num_clients, cfg.federation.clients_per_round

    @classmethod
    def build(cls, cfg: Any, num_clients: int) -> "Rounds":
        return (ClockRounds if cfg.system.enabled else Rounds)(cfg, num_clients)

    def select(self, round_: int) -> list[int]:
        """The round's clients, sorted."""
        return sample_clients(self.seed, round_, self.num_clients, self.per_round)

    def admit(self, clients: list[int], infos: list[dict], bytes_down: list[int]) -> list[int]:
        """Of the clients that finished (client-id order), those whose upload reaches the server: all of them."""
        return clients

    def sim(self, step: Step) -> dict[str, float]:
        """The step's ``sim/*`` figures: none without a system."""
        return {}

    def step(self, round_: int, work: Work) -> Report:
        step, down = fresh_round(work, round_, self.select(round_), self.admit)
        sim = self.sim(step)
        return Report(step, float(sum(down)), sim, self.events())

    def events(self) -> dict[str, Any] | None:
        """The round's rows of ``events.parquet``: none without a system."""
        return None


def fresh_round(work: Work, round_: int, clients: list[int],
                admit: Callable[[list[int], list[dict], list[int]], list[int]] | None = None) -> tuple[Step, list[int]]:
    """A synchronous round of ``clients`` (sorted): started from the current model (version ``round_ - 1``: one
    server step a round), their results taken, the uploads ``admit`` lets through (all without it) aggregated with
    the method's own weights, the others dropped. Returns the step and the bytes sent to each client."""
    version = round_ - 1
    down = work.start(round_, clients, version)
    finished = [(c, info, d) for c, info, d in zip(clients, work.results(clients), down) if info is not None]
    if not finished:
        raise RunFailure(f"round {round_}: no client finished (all dropped after failures or timeouts)")
    ids = [c for c, _, _ in finished]
    kept = admit(ids, [info for _, info, _ in finished], [d for _, _, d in finished]) if admit else ids
    arrived = set(kept)
    work.drop([c for c in ids if c not in arrived])
    return work.step(round_, kept, [version] * len(kept), None), down


class ClockRounds(Rounds):
    """Synchronous rounds on the simulated clock: sampling among the online clients, over-commitment, deadlines,
    dropouts (:class:`~fedray.system.clock.SystemClock`)."""

    def __init__(self, cfg: Any, num_clients: int):
        super().__init__(cfg, num_clients)
        self.clock = SystemClock(cfg.system, num_clients, self.per_round, cfg.seed)

    def select(self, round_: int) -> list[int]:
        return self.clock.select(round_)

    def register(self, sizes: np.ndarray) -> None:
        self.clock.register(sizes)

    def admit(self, clients: list[int], infos: list[dict], bytes_down: list[int]) -> list[int]:
        return self.clock.admit(clients, [i["work_samples"] for i in infos], [i["bytes_up"] for i in infos],
                                np.asarray(bytes_down, dtype=np.float64),
                                [i.get(UTILITY, np.nan) for i in infos])

    def sim(self, step: Step) -> dict[str, float]:
        return self.clock.end_round(step.metrics.get("sim/server_samples", 0.0))

    def events(self) -> dict[str, Any] | None:
        return self.clock.last_events

    def client_columns(self, client_ids) -> dict[str, np.ndarray]:
        return self.clock.client_columns(client_ids)

    def state(self) -> dict[str, Any]:
        return self.clock.state()

    def load(self, state: dict[str, Any]) -> None:
        self.clock.load(state)


__all__ = ["ClockRounds", "Rounds", "fresh_round"]
