"""Buffered asynchronous aggregation on the simulated clock (FedBuff: Nguyen et al., AISTATS 2022, Alg. 1).

``federation.concurrency`` clients train at once, each from the model of the server step it was dispatched at; an
upload joins the buffer when the client finishes on the simulated clock, and every ``federation.buffer_size``
uploads the server takes one step, each upload's change weighted by its staleness (``federation.staleness``:
1, or FedBuff's 1/sqrt(1 + tau) for an upload tau steps old). A dispatched client finishes ``t_k`` after its start
(:meth:`~fedray.system.devices.Devices.client_time`) unless it goes offline first or ``t_k`` passes
``system.deadline_s`` (a dropout: its work is lost and another client takes its place). Events are ordered by
simulated time (ties by client id), never by when the work's results come back, so the same config gives the same
figures in process, on Ray and after a resume. Only online clients that are neither training nor waiting in the
buffer are dispatched (seeded by the run seed and the dispatch's number).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedray.errors import ConfigError, RunFailure
from fedray.seeding import derive_rng
from fedray.system.clock import SystemClock, events
from fedray.system.protocol import Report, Schedule, Step, Work

#: A server step gives up after this many dropouts in a row per client training at once: no upload can arrive (a
#: deadline shorter than every client's work, or phones never online long enough)
DROPOUTS_PER_SLOT = 100


def staleness_weight(kind: str, tau: int) -> float:
    """The weight of an upload ``tau`` server steps old: 1 (``none``) or 1 / sqrt(1 + tau) (``polynomial``)."""
    return 1.0 if kind == "none" else 1.0 / math.sqrt(1.0 + tau)


@dataclass
class Flight:
    """A client in training: the version it trains from, when it started, when it goes offline (seconds after its
    start), the bytes it was sent and, once its work's figures are known, its finish time (seconds after start)."""

    version: int
    start: float
    offline: float
    down: float = 0.0
    t: float | None = None
    parts: dict[str, float] | None = None  # t's parts (events.parquet)

    def settled(self, deadline: float) -> float:
        """Seconds after its start when the server knows the client's fate."""
        return min(self.t, self.offline, deadline)


class FedBuff(Schedule):
    """Who trains, from which server version, and when each finishes; the buffer; the server's version."""

    name = "async"
    stale = True

    def __init__(self, clock: SystemClock, concurrency: int, buffer_size: int, staleness: str):
        self.clock, self.concurrency, self.buffer_size, self.staleness = clock, concurrency, buffer_size, staleness
        self.version = 0  # server steps taken
        self.dispatches = 0  # dispatch decisions taken (seeds the draws)
        self.flight: dict[int, Flight] = {}
        self.buffer: list[tuple[int, int, float]] = []  # (client, version, arrival time)
        self.settled: list[tuple] = []  # this step's (client, start, settled at, t's parts, fate): events.parquet

    @classmethod
    def build(cls, cfg: Any, num_clients: int) -> "FedBuff":
        fed = cfg.federation
        return cls(SystemClock(cfg.system, num_clients, fed.clients_per_round, cfg.seed), fed.in_flight(),
                   fed.buffer(), fed.staleness)

    @classmethod
    def check(cls, cfg: Any) -> None:
        fed, system, num_clients = cfg.federation, cfg.system, cfg.data.num_clients
        if not system.enabled:
            raise ConfigError("federation.mode", "async orders the uploads by simulated time; set system.devices "
                              "to uniform, heterogeneous, trace or fedscale (docs/system.md)")
        if system.selection != "uniform":
            raise ConfigError("system.selection", f"{system.selection} picks a synchronous round's clients; FedBuff "
                              "dispatches uniformly among those online: set system.selection=uniform")
        if system.overcommit != 1:
            raise ConfigError("system.overcommit", "over-selection is for synchronous rounds; with "
                              "federation.mode=async set federation.concurrency instead")
        if fed.buffer() > num_clients:
            raise ConfigError("federation.buffer_size", f"{fed.buffer()} exceeds data.num_clients={num_clients}: "
                              "a client's upload waits in the buffer until the step, so at most that many fit; "
                              f"allowed: 1..{num_clients}")
        if fed.in_flight() > num_clients:
            raise ConfigError("federation.concurrency", f"{fed.in_flight()} exceeds data.num_clients="
                              f"{num_clients}; allowed: 1..{num_clients}")

    def step(self, round_: int, work: Work) -> Report:
        """Round ``round_``: one server step. Clients are dispatched until the buffer holds ``buffer_size`` uploads,
        each event taken in simulated-time order; the work itself is the runtime's (on Ray it runs while the driver
        waits for the figures that time it)."""
        clock = self.clock
        start, down, dispatched, dropouts, idle = clock.clock, 0.0, 0, 0, 0.0
        self.settled = []
        late = offline = 0
        fastest = math.inf
        while len(self.buffer) < self.buffer_size:
            chosen, waited = self.dispatch()
            idle += waited
            if chosen:
                sent = work.start(self.version + 1, chosen, self.version)
                for cid, nbytes in zip(chosen, sent):
                    self.flight[cid].down = nbytes
                    down += nbytes
                dispatched += len(chosen)
            self.time(work)
            cid, arrived, t = self.next_event()
            if not arrived:
                work.drop([cid])
                dropouts += 1
                deadline = clock.cfg.deadline_s if clock.cfg.deadline_s is not None else math.inf
                late, offline = late + (t > deadline), offline + (t <= deadline)
                fastest = min(fastest, t)
                if dropouts > DROPOUTS_PER_SLOT * self.concurrency and not self.buffer:
                    raise clock.no_arrivals(f"round {round_}: {dropouts} clients in a row dropped out and none "
                                            "arrived", late, offline, fastest)
        clients, versions, weights, taus = self.take_buffer()
        step = work.step(round_, clients, versions, weights)
        server_s = (step.metrics.get("sim/server_samples", 0.0) / clock.cfg.server_sps) if clock.cfg.server_sps else 0.0
        clock.clock += server_s
        online, _ = clock.availability.at(clock.clock)
        sim = {"sim/round_s": clock.clock - start, "sim/clock_s": clock.clock, "sim/available": float(online.sum()),
               "sim/selected": float(dispatched), "sim/stragglers": 0.0, "sim/dropouts": float(dropouts),
               "sim/server_s": server_s, "sim/staleness": float(np.mean(taus)), "sim/idle_s": idle}
        return Report(step, down, sim, self._events())

    def _events(self) -> dict[str, Any]:
        """The step's rows of events.parquet: every client whose fate was settled during it."""
        ids = np.array([c for c, *_ in self.settled], dtype=np.int64)
        parts = {k: np.array([p[k] for *_, p, _ in self.settled]) for k in ("latency_s", "download_s", "compute_s",
                                                                          "upload_s")}
        return events(ids, np.array([s for _, s, *_ in self.settled]), np.array([e for _, _, e, *_ in self.settled]),
                      parts, np.array([f for *_, f in self.settled]))

    def dispatch(self) -> tuple[list[int], float]:
        """Clients to start now from the current version, filling the clients in training up to ``concurrency``
        (sorted), and the simulated seconds waited first: with none in training and nobody to start, the clock
        first moves to the next change of availability."""
        waited_from = self.clock.clock
        while True:
            online, until = self.clock.availability.at(self.clock.clock)
            busy = np.zeros(online.size, dtype=bool)
            busy[list(self.flight) + [c for c, _, _ in self.buffer]] = True
            eligible = np.flatnonzero(online & ~busy)
            if eligible.size or self.flight:
                break
            nxt = self.clock.availability.next_change(self.clock.clock)
            if math.isinf(nxt):
                raise RunFailure(f"no client can train at simulated time {self.clock.clock:.0f} s or later (the "
                                 "availability trace ends); give a longer system.availability_trace or fewer rounds",
                                 resumable=False)
            self.clock.clock = nxt
        waited = self.clock.clock - waited_from
        want = min(self.concurrency - len(self.flight), eligible.size)
        if want <= 0:
            return [], waited
        chosen = np.sort(derive_rng(self.clock.seed, "async", self.dispatches).choice(eligible, size=want,
                                                                                      replace=False))
        self.dispatches += 1
        for c in chosen:
            self.flight[int(c)] = Flight(self.version, self.clock.clock, float(until[c]) - self.clock.clock)
        return [int(c) for c in chosen], waited

    def time(self, work: Work) -> None:
        """The finish time of every client in training whose time is not known yet (its work's figures are
        needed: the work runs meanwhile), from its samples, its upload and the payload it was sent."""
        untimed = sorted(c for c, f in self.flight.items() if f.t is None)
        if not untimed:
            return
        for cid, info in zip(untimed, work.results(untimed)):
            if info is None:
                raise RunFailure(f"client {cid}'s work was lost (its worker failed past "
                                 "runtime.max_client_retries); resume the run from its last checkpoint")
            f = self.flight[cid]
            parts = self.clock.devices.time_parts(np.array([cid]), np.array([info["work_samples"]], dtype=np.float64),
                                                  float(f.down), np.array([info["bytes_up"]], dtype=np.float64),
                                                  f.version + 1)  # speeds vary by the step it trains for
            f.parts = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in parts.items()}
            f.t = f.parts["latency_s"] + f.parts["download_s"] + f.parts["compute_s"] + f.parts["upload_s"]

    def next_event(self) -> tuple[int, bool, float]:
        """The earliest event among the clients in training, taken: (client, whether its upload arrived, its
        finish time t_k after its start). The clock moves to it; an arrival joins the buffer."""
        deadline = self.clock.cfg.deadline_s if self.clock.cfg.deadline_s is not None else math.inf
        client = min(self.flight, key=lambda c: (self.flight[c].start + self.flight[c].settled(deadline), c))
        f = self.flight.pop(client)
        arrived = f.t <= f.offline and f.t <= deadline
        self.clock.clock = max(self.clock.clock, f.start + f.settled(deadline))
        self.clock.busy_s[client] += f.settled(deadline)
        if arrived:
            self.buffer.append((client, f.version, self.clock.clock))
        fate = "aggregated" if arrived else "dropout_deadline" if f.t > deadline else "dropout_offline"
        self.settled.append((client, f.start, self.clock.clock, f.parts, fate))
        return client, arrived, f.t

    def take_buffer(self) -> tuple[list[int], list[int], list[float], list[int]]:
        """The server step: (clients, versions, staleness weights, staleness), in client-id order; the version
        moves on."""
        taken = sorted(self.buffer)
        self.buffer = []
        taus = [self.version - v for _, v, _ in taken]
        self.version += 1
        clients = [c for c, _, _ in taken]
        self.clock.rounds[clients] += 1
        return clients, [v for _, v, _ in taken], [staleness_weight(self.staleness, t) for t in taus], taus

    def client_columns(self, client_ids) -> dict[str, np.ndarray]:
        return self.clock.client_columns(client_ids)

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "dispatches": self.dispatches,
                "flight": {c: {"version": f.version, "start": f.start, "offline": f.offline}
                           for c, f in self.flight.items()},
                "buffer": list(self.buffer), "clock": self.clock.state()}

    def load(self, state: dict[str, Any]) -> None:
        self.version, self.dispatches = int(state["version"]), int(state["dispatches"])
        self.flight = {int(c): Flight(int(f["version"]), float(f["start"]), float(f["offline"]))
                       for c, f in state["flight"].items()}
        self.buffer = [tuple(b) for b in state["buffer"]]
        self.clock.load(state["clock"])

    def restart(self, work: Work) -> None:
        """The work in flight at the checkpoint, started again from the payloads the checkpoint kept."""
        for cid in sorted(self.flight):
            f = self.flight[cid]
            (f.down,) = work.start(f.version + 1, [cid], f.version)


__all__ = ["DROPOUTS_PER_SLOT", "FedBuff", "Flight", "staleness_weight"]
