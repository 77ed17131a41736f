"""When each client is online: always, alternating exponential periods (a two-state Markov chain), or a trace
(ending after its last interval, or repeating: :class:`CyclicTrace`, which FedScale's behaviour traces also read as).

Each model answers, at a simulated time ``t`` that never goes back, which clients are online and until when each
online client stays so (the end of its current online period: a client selected at ``t`` whose work ends after it
drops out). State is a few arrays over all registered clients, so 100,000 clients cost megabytes, not objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedray.seeding import derive_seed


def array(saved: Any, dtype) -> np.ndarray:
    """A checkpoint's array (it stores numpy arrays as tensors) as a numpy array of ``dtype``, a copy."""
    return np.array(saved.numpy() if hasattr(saved, "numpy") else saved, dtype=dtype)


class Always:
    """Every client online at every time."""

    def __init__(self, num_clients: int):
        self.num_clients = num_clients

    def at(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        """(online mask, end of each client's current online period: inf here) at ``t``."""
        return np.ones(self.num_clients, dtype=bool), np.full(self.num_clients, np.inf)

    def next_online(self, t: float) -> float:
        return t

    def next_change(self, t: float) -> float:
        """The first time after ``t`` that some client comes online or goes offline (inf: never)."""
        return np.inf

    def state(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        pass


class Markov:
    """Each client alternates online and offline periods whose lengths are exponential with means ``mean_online_s``
    and ``mean_offline_s`` (a two-state continuous-time Markov chain, the availability model of FLSim's and of
    Bonawitz et al.'s analyses). At time 0 a client is online with the chain's stationary probability
    on / (on + off), and its current period's remaining length is exponential with that state's mean (memoryless).
    Draws come from one generator seeded by (run seed, "availability"), in client-id order among the clients whose
    period ends, so the same sequence of times gives the same states; the generator's state is checkpointed."""

    def __init__(self, num_clients: int, mean_online_s: float, mean_offline_s: float, seed: int):
        self.means = np.array([mean_offline_s, mean_online_s])  # indexed by the state: 0 offline, 1 online
        self.rng = np.random.default_rng(derive_seed(seed, "availability"))
        p_on = mean_online_s / (mean_online_s + mean_offline_s)
        self.online = self.rng.random(num_clients) < p_on
        self.until = self.rng.exponential(self.means[self.online.astype(np.int64)])  # when the current period ends
        self.time = 0.0

    def _advance(self, t: float) -> None:
        assert t >= self.time, "the simulated clock never goes back"
        while True:
            ends = np.flatnonzero(self.until <= t)
            if not ends.size:
                break
            self.online[ends] = ~self.online[ends]
            self.until[ends] += self.rng.exponential(self.means[self.online[ends].astype(np.int64)])
        self.time = t

    def at(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        self._advance(t)
        return self.online.copy(), np.where(self.online, self.until, -np.inf)

    def next_online(self, t: float) -> float:
        self._advance(t)
        return t if self.online.any() else float(self.until.min())

    def next_change(self, t: float) -> float:
        self._advance(t)
        return float(self.until.min())

    def state(self) -> dict[str, Any]:
        return {"online": self.online.copy(), "until": self.until.copy(), "time": self.time,
                "rng": self.rng.bit_generator.state}

    def load(self, state: dict[str, Any]) -> None:
        self.online, self.until = array(state["online"], bool), array(state["until"], np.float64)
        self.time = float(state["time"])
        self.rng.bit_generator.state = state["rng"]


class TraceAvailability:
    """The online intervals ``[start_s, end_s)`` of a trace (sorted by client, then start; disjoint per client);
    a client is offline outside them, and after the trace's last interval for good."""

    def __init__(self, num_clients: int, client: np.ndarray, start: np.ndarray, end: np.ndarray):
        self.num_clients, self.client, self.start, self.end = num_clients, client, start, end

    def at(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        inside = (self.start <= t) & (t < self.end)
        online = np.zeros(self.num_clients, dtype=bool)
        until = np.full(self.num_clients, -np.inf)
        online[self.client[inside]] = True
        until[self.client[inside]] = self.end[inside]
        return online, until

    def next_online(self, t: float) -> float:
        if ((self.start <= t) & (t < self.end)).any():
            return t
        later = self.start[self.start > t]
        return float(later.min()) if later.size else np.inf

    def next_change(self, t: float) -> float:
        later = np.concatenate([self.start[self.start > t], self.end[self.end > t]])
        return float(later.min()) if later.size else np.inf

    def state(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        pass


class CyclicTrace:
    """Online intervals that repeat: client c's intervals ``[start, end)`` (sorted by client, then start; within
    ``[0, period[c]]``, disjoint, touching ones merged) recur every ``period[c]`` seconds, for ever. Periods may
    differ per client (FedScale's ``finish_time`` does). A client online at the end of its cycle and at the start of
    the next (an interval ending at the period, another starting at 0) stays online across the boundary: its online
    period ends where the next cycle's first interval does (never, for a client online the whole cycle).

    Stateless: every answer is a function of ``t`` over per-interval arrays (no loop over clients). A time within
    ``max(1e-9, 1e-12 t)`` s of an interval's edge counts as at that edge, so that a time this class returned (a
    start, an end) reads back as that start or end whatever the rounding of ``t mod period``."""

    def __init__(self, num_clients: int, client: np.ndarray, start: np.ndarray, end: np.ndarray,
                 period: np.ndarray):
        self.num_clients, self.client, self.start, self.end = num_clients, client, start, end
        self.period = np.asarray(period, dtype=np.float64)[client]  # per interval: its client's
        # each client's first and last interval (the intervals come sorted by client, then start)
        ids, first_of, count = np.unique(client, return_index=True, return_counts=True)
        first = np.full(num_clients, -1, dtype=np.int64)
        last = np.full(num_clients, -1, dtype=np.int64)
        first[ids], last[ids] = first_of, first_of + count - 1
        # An interval that ends at the period runs on into the next cycle when its client's first interval starts
        # at 0: its online period ends with that first interval (never, when the two are one interval [0, period]).
        runs_on = (end == self.period) & (start[first[client]] == 0)
        self.extra = np.where(runs_on, np.where(first[client] == np.arange(client.size), np.inf,
                                                end[first[client]]), 0.0)
        # Such a boundary is no change: the end at the period and the start at 0 it runs into.
        self.end_changes = ~runs_on
        self.start_changes = ~((start == 0) & (end[last[client]] == self.period[last[client]]))

    def _phase(self, t: float) -> tuple[np.ndarray, np.ndarray, float]:
        """Per interval: the start of the cycle holding ``t``, ``t``'s offset in it, and the tolerance."""
        tol = max(1e-9, 1e-12 * abs(t))
        base = np.floor(t / self.period) * self.period
        norm = t - base
        wrap = norm > self.period - tol  # a rounding error short of the cycle's end: the next cycle's start
        return np.where(wrap, base + self.period, base), np.where(wrap, norm - self.period, norm), tol

    def _inside(self, norm: np.ndarray, tol: float) -> np.ndarray:
        return (self.start - tol <= norm) & (norm < self.end - tol)

    def at(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        base, norm, tol = self._phase(t)
        inside = self._inside(norm, tol)
        online = np.zeros(self.num_clients, dtype=bool)
        until = np.full(self.num_clients, -np.inf)
        online[self.client[inside]] = True
        until[self.client[inside]] = (base + self.end + self.extra)[inside]
        return online, until

    def _next(self, edge: np.ndarray, base: np.ndarray, norm: np.ndarray, tol: float) -> np.ndarray:
        """Per interval, the first occurrence of ``edge`` (its start or end) after ``t``: this cycle's or the next."""
        return np.where(edge - tol > norm, base + edge, base + self.period + edge)

    def next_online(self, t: float) -> float:
        base, norm, tol = self._phase(t)
        if self._inside(norm, tol).any():
            return t
        return float(self._next(self.start, base, norm, tol).min()) if self.start.size else np.inf

    def next_change(self, t: float) -> float:
        base, norm, tol = self._phase(t)
        starts = self._next(self.start, base, norm, tol)[self.start_changes]
        ends = self._next(self.end, base, norm, tol)[self.end_changes]
        later = np.concatenate([starts, ends])
        return float(later.min()) if later.size else np.inf  # inf: everyone always online, or never

    def state(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        pass
