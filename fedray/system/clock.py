"""The virtual clock of a synchronous round: who is sampled, when each selected client finishes, whose upload
arrives, how long the round takes.

A selected client k finishes ``t_k = latency_k + bytes_down / down_k + samples_k / compute_sps_k + latency_k +
bytes_up_k / up_k`` after the round's start (:meth:`Devices.client_time`). It is a *dropout* when it goes offline
before then (its online period ends) or when ``t_k`` exceeds ``system.deadline_s``; of the others, the first
``federation.clients_per_round`` by ``t_k`` (ties by client id) are aggregated and the rest are *stragglers*. The
round ends when the server stops waiting: at the k-th arrival, or once every selected client has arrived, gone
offline or passed the deadline, whichever is first; then the server's own work takes ``server_samples /
server_sps``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedray.errors import RunFailure
from fedray.seeding import derive_rng
from fedray.system.availability import Always, Markov, TraceAvailability, array
from fedray.system.config import SystemConfig
from fedray.system.devices import Devices
from fedray.system.traces import read_availability_trace


def build_availability(cfg: SystemConfig, num_clients: int, seed: int):
    if cfg.availability == "markov":
        return Markov(num_clients, cfg.mean_online_s, cfg.mean_offline_s, seed)
    if cfg.availability == "trace":
        return TraceAvailability(num_clients, *read_availability_trace("system.availability_trace",
                                                                       cfg.availability_trace, num_clients))
    return Always(num_clients)


class SystemClock:
    """The simulated system of one run: devices, availability, the clock, each client's participation and busy
    time. Its state (:meth:`state`) goes into the checkpoint, so a resumed run continues the same clock."""

    def __init__(self, cfg: SystemConfig, num_clients: int, per_round: int, seed: int):
        self.cfg, self.num_clients, self.per_round, self.seed = cfg, num_clients, per_round, seed
        self.devices = Devices.build(cfg, num_clients, seed)
        self.availability = build_availability(cfg, num_clients, seed)
        self.clock = 0.0
        self.rounds = np.zeros(num_clients, dtype=np.int64)  # rounds whose aggregate holds the client's upload
        self.busy_s = np.zeros(num_clients)  # simulated seconds the client spent on rounds it was selected for
        self._round: dict[str, Any] | None = None

    def select(self, round_: int) -> list[int]:
        """The clients of ``round_``: ceil(clients_per_round x overcommit) drawn (seeded by run seed and round) from
        those online at the round's start, all of them when fewer are online. With nobody online the clock first
        moves to the next time someone is."""
        start = self.availability.next_online(self.clock)
        if math.isinf(start):
            raise RunFailure(f"round {round_}: no client is online at simulated time {self.clock:.0f} s or later (the "
                             "availability trace ends); give a longer system.availability_trace or fewer rounds")
        waited, self.clock = start - self.clock, start
        online, until = self.availability.at(self.clock)
        ids = np.flatnonzero(online)
        want = min(math.ceil(self.per_round * self.cfg.overcommit - 1e-9), ids.size)
        chosen = derive_rng(self.seed, "sample", round_).choice(ids, size=want, replace=False)
        chosen = np.sort(chosen)
        self._round = {"start": self.clock, "waited": waited, "available": int(ids.size), "ids": chosen,
                       "until": until[chosen] - self.clock}
        return [int(c) for c in chosen]

    def admit(self, client_ids: list[int], samples: list[int], bytes_up: list[int], bytes_down) -> list[int]:
        """The clients among ``client_ids`` (those of :meth:`select` that finished their work) whose upload reaches
        the server, in client-id order; records the round's figures for :meth:`end_round`. ``bytes_down``: what
        each was sent (one number for all, or one per client)."""
        r = self._round
        assert r is not None, "select comes first"
        ids = np.asarray(client_ids, dtype=np.int64)
        t = self.devices.client_time(ids, np.asarray(samples, dtype=np.float64),
                                     np.asarray(bytes_down, dtype=np.float64),
                                     np.asarray(bytes_up, dtype=np.float64))
        offline_at = r["until"][np.searchsorted(r["ids"], ids)]  # seconds after the start it goes offline
        deadline = self.cfg.deadline_s if self.cfg.deadline_s is not None else math.inf
        dropped = (offline_at < t) | (t > deadline)
        order = [i for i in np.lexsort((ids, t)) if not dropped[i]]
        arrived = np.zeros(ids.size, dtype=bool)
        arrived[order[: self.per_round]] = True
        # When the server knows a client's fate: its arrival, its going offline, or the deadline passing.
        settled = np.minimum(np.minimum(t, offline_at), deadline)
        wait = float(settled.max()) if ids.size else 0.0  # everyone's fate is known ...
        if arrived.sum() == self.per_round:  # ... or the k-th upload is in, whichever comes first
            wait = min(wait, float(t[arrived].max()))
        busy = np.minimum(settled, wait)
        self.busy_s[ids] += busy
        self.rounds[ids[arrived]] += 1
        r.update(wait=wait, dropouts=int(dropped.sum()), stragglers=int((~dropped & ~arrived).sum()),
                 lost=len(r["ids"]) - ids.size)
        return [int(c) for c in ids[arrived]]

    def end_round(self, server_samples: float) -> dict[str, float]:
        """Moves the clock past the round and the server's work; the round's ``sim/*`` figures."""
        r, self._round = self._round, None
        assert r is not None and "wait" in r, "admit comes before end_round"
        server_s = server_samples / self.cfg.server_sps if self.cfg.server_sps else 0.0
        round_s = r["waited"] + r["wait"] + server_s
        self.clock = r["start"] + r["wait"] + server_s
        return {"sim/round_s": round_s, "sim/clock_s": self.clock, "sim/available": float(r["available"]),
                "sim/selected": float(len(r["ids"])), "sim/stragglers": float(r["stragglers"]),
                "sim/dropouts": float(r["dropouts"] + r["lost"]), "sim/server_s": server_s}

    def client_columns(self, client_ids) -> dict[str, np.ndarray]:
        """Per client of ``client_ids``: rounds aggregated and simulated busy seconds so far (clients.parquet)."""
        ids = np.asarray(client_ids, dtype=np.int64)
        return {"sim_rounds": self.rounds[ids].copy(), "sim_busy_s": self.busy_s[ids].copy()}

    def state(self) -> dict[str, Any]:
        return {"clock": self.clock, "rounds": self.rounds.copy(), "busy_s": self.busy_s.copy(),
                "availability": self.availability.state()}

    def load(self, state: dict[str, Any]) -> None:
        self.clock = float(state["clock"])
        self.rounds, self.busy_s = array(state["rounds"], np.int64), array(state["busy_s"], np.float64)
        self.availability.load(state["availability"])
