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
from typing import Any

import numpy as np

from fedray.errors import RunFailure
from fedray.seeding import derive_rng
from fedray.system.clock import SystemClock


def staleness_weight(kind: str, tau: int) -> float:
    """The weight of an upload ``tau`` server steps old: 1 (``none``) or 1 / sqrt(1 + tau) (``polynomial``)."""
    return 1.0 if kind == "none" else 1.0 / math.sqrt(1.0 + tau)


class AsyncSchedule:
    """Who trains, from which server version, and when each finishes; the buffer; the server's version."""

    def __init__(self, clock: SystemClock, concurrency: int, buffer_size: int, staleness: str):
        self.clock, self.concurrency, self.buffer_size, self.staleness = clock, concurrency, buffer_size, staleness
        self.version = 0  # server steps taken
        self.dispatches = 0  # dispatch decisions taken (seeds the draws)
        # client -> version, start, offline (s after start), down (payload bytes), t (None until timed)
        self.flight: dict[int, dict[str, Any]] = {}
        self.buffer: list[tuple[int, int, float]] = []  # (client, version, arrival time)

    def dispatch(self) -> list[tuple[int, int]]:
        """(client, version) pairs to start now, filling the clients in training up to ``concurrency``. With none
        in training and nobody to start, the clock first moves to the next change of availability."""
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
                                 "availability trace ends); give a longer system.availability_trace or fewer rounds")
            self.clock.clock = nxt
        want = min(self.concurrency - len(self.flight), eligible.size)
        if want <= 0:
            return []
        chosen = np.sort(derive_rng(self.clock.seed, "async", self.dispatches).choice(eligible, size=want,
                                                                                      replace=False))
        self.dispatches += 1
        for c in chosen:
            self.flight[int(c)] = {"version": self.version, "start": self.clock.clock,
                                   "offline": float(until[c]) - self.clock.clock, "t": None}
        return [(int(c), self.version) for c in chosen]

    def untimed(self) -> list[int]:
        """Clients in training whose finish time is not known yet (their work's figures are needed), in id order."""
        return sorted(c for c, f in self.flight.items() if f["t"] is None)

    def time(self, client: int, samples: float, bytes_up: float) -> None:
        """Its finish time, from its work's samples and upload and the payload it received (``flight[c]["down"]``,
        bytes, set when it was submitted)."""
        f = self.flight[client]
        f["t"] = float(self.clock.devices.client_time(np.array([client]), np.array([samples], dtype=np.float64),
                                                      float(f["down"]), np.array([bytes_up], dtype=np.float64))[0])

    def next_event(self) -> tuple[int, bool]:
        """The earliest event among the clients in training, taken: (client, whether its upload arrived). The clock
        moves to it; an arrival joins the buffer."""
        deadline = self.clock.cfg.deadline_s if self.clock.cfg.deadline_s is not None else math.inf

        def settled(f):  # seconds after its start when the client's fate is known
            return min(f["t"], f["offline"], deadline)

        client = min(self.flight, key=lambda c: (self.flight[c]["start"] + settled(self.flight[c]), c))
        f = self.flight.pop(client)
        arrived = f["t"] <= f["offline"] and f["t"] <= deadline
        self.clock.clock = max(self.clock.clock, f["start"] + settled(f))
        self.clock.busy_s[client] += settled(f)
        if arrived:
            self.buffer.append((client, f["version"], self.clock.clock))
        return client, arrived

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

    def live(self) -> list[int]:
        """The server versions clients are still training from."""
        return sorted({f["version"] for f in self.flight.values()})

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "dispatches": self.dispatches,
                "flight": {c: {k: v for k, v in f.items() if k not in ("t", "down")} for c, f in self.flight.items()},
                "buffer": list(self.buffer), "clock": self.clock.state()}

    def load(self, state: dict[str, Any]) -> None:
        self.version, self.dispatches = int(state["version"]), int(state["dispatches"])
        self.flight = {int(c): {**f, "t": None} for c, f in state["flight"].items()}
        self.buffer = [tuple(b) for b in state["buffer"]]
        self.clock.load(state["clock"])


__all__ = ["AsyncSchedule", "staleness_weight"]
