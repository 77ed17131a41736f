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
from fedray.system.availability import Always, CyclicTrace, Markov, TraceAvailability, array
from fedray.system.config import SystemConfig
from fedray.system.devices import Devices
from fedray.system.fedscale import read_fedscale_behaviour
from fedray.system.oort import Oort
from fedray.system.traces import read_availability_trace


def events(ids: np.ndarray, start: Any, end: np.ndarray, parts: dict[str, np.ndarray], fate: np.ndarray,
           lost: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A step's rows of ``events.parquet``, by client: its simulated start, when its fate was settled (its arrival,
    its going offline or the deadline), t_k and its parts, and its fate. ``lost``: clients whose work the runtime
    lost (started at ``start``, no times: NaN, fate ``lost``)."""
    lost = np.zeros(0, dtype=np.int64) if lost is None else np.asarray(lost, dtype=np.int64)
    nan = np.full(lost.size, np.nan)
    t = parts["latency_s"] + parts["download_s"] + parts["compute_s"] + parts["upload_s"]
    start = np.broadcast_to(np.asarray(start, dtype=np.float64), ids.shape)
    cols = {"client": np.concatenate([ids, lost]).astype(np.int64),
            "start_s": np.concatenate([start, np.full(lost.size, start[0] if start.size else np.nan)]),
            "end_s": np.concatenate([end, nan]), "t_s": np.concatenate([t, nan]),
            **{k: np.concatenate([np.broadcast_to(v, ids.shape).astype(np.float64), nan]) for k, v in parts.items()},
            "outcome": np.concatenate([fate.astype(str), np.full(lost.size, "lost")]).astype(object)}
    order = np.argsort(cols["client"], kind="stable")
    return {k: v[order] for k, v in cols.items()}


#: Synchronous rounds in a row without an arriving upload after which the run stops (its accuracy would stay frozen).
DRY_ROUNDS = 5


def build_availability(cfg: SystemConfig, num_clients: int, seed: int):
    if cfg.availability == "markov":
        return Markov(num_clients, cfg.mean_online_s, cfg.mean_offline_s, seed)
    if cfg.availability == "trace" and cfg.availability_cycle_s is not None:
        intervals = read_availability_trace("system.availability_trace", cfg.availability_trace, num_clients,
                                            cfg.availability_cycle_s)
        return CyclicTrace(num_clients, *intervals, np.full(num_clients, cfg.availability_cycle_s))
    if cfg.availability == "trace":
        return TraceAvailability(num_clients, *read_availability_trace("system.availability_trace",
                                                                       cfg.availability_trace, num_clients))
    if cfg.availability == "fedscale":  # each client's intervals repeat with its entry's finish_time
        return CyclicTrace(num_clients, *read_fedscale_behaviour("system.availability_trace", cfg.availability_trace,
                                                                 num_clients))
    return Always(num_clients)


def online_seconds(cfg: SystemConfig, num_clients: int, seed: int, horizon_s: float) -> np.ndarray:
    """The simulated seconds each client is online over [0, ``horizon_s``] under the run's availability process
    (``build_availability`` with the run's seed: the very process its clock walks)."""
    availability = build_availability(cfg, num_clients, seed)
    online, t = np.zeros(num_clients), 0.0
    while t < horizon_s:
        mask, _ = availability.at(t)
        nxt = min(max(availability.next_change(t), np.nextafter(t, np.inf)), horizon_s)
        online += mask * (nxt - t)
        t = nxt
    return online


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
        self.last_events: dict[str, np.ndarray] | None = None  # the last round's rows of events.parquet
        # rounds in a row in which no upload arrived, and why theirs were lost (the stop after DRY_ROUNDS of them)
        self.dry = {"rounds": 0, "late": 0, "offline": 0, "fastest": math.inf}
        self.oort = Oort(cfg.oort, num_clients, seed) if cfg.selection == "oort" else None

    def register(self, sizes: np.ndarray) -> None:
        """The clients' training-set sizes, as they declare them when they register (Oort ranks unexplored clients
        by them)."""
        if self.oort is not None:
            self.oort.register(sizes)

    def select(self, round_: int) -> list[int]:
        """The clients of ``round_``: ceil(clients_per_round x overcommit) drawn (seeded by run seed and round) from
        those online at the round's start, uniformly or by Oort (``system.selection``), all of them when fewer are
        online. With nobody online the clock first moves to the next time someone is."""
        start = self.availability.next_online(self.clock)
        if math.isinf(start):
            raise RunFailure(f"round {round_}: no client is online at simulated time {self.clock:.0f} s or later (the "
                             "availability trace ends); give a longer system.availability_trace or fewer rounds",
                             resumable=False)
        waited, self.clock = start - self.clock, start
        online, until = self.availability.at(self.clock)
        ids = np.flatnonzero(online)
        want = min(math.ceil(self.per_round * self.cfg.overcommit - 1e-9), ids.size)
        if self.oort is not None and want < ids.size:
            chosen = self.oort.select(round_, ids, want)
        else:
            chosen = np.sort(derive_rng(self.seed, "sample", round_).choice(ids, size=want, replace=False))
            if self.oort is not None:
                self.oort.take_all(chosen)
        self._round = {"round": round_, "start": self.clock, "waited": waited, "available": int(ids.size), "ids": chosen,
                       "until": until[chosen] - self.clock}
        return [int(c) for c in chosen]

    def admit(self, client_ids: list[int], samples: list[int], bytes_up: list[int], bytes_down,
              utility: list[float] | None = None) -> list[int]:
        """The clients among ``client_ids`` (those of :meth:`select` that finished their work) whose upload reaches
        the server, in client-id order; records the round's figures for :meth:`end_round`. ``bytes_down``: what
        each was sent (one number for all, or one per client). ``utility``: each client's reported statistical
        utility (Oort's feedback, with the durations the server measured)."""
        r = self._round
        assert r is not None, "select comes first"
        ids = np.asarray(client_ids, dtype=np.int64)
        parts = self.devices.time_parts(ids, np.asarray(samples, dtype=np.float64),
                                        np.asarray(bytes_down, dtype=np.float64),
                                        np.asarray(bytes_up, dtype=np.float64), r["round"])
        t = parts["latency_s"] + parts["download_s"] + parts["compute_s"] + parts["upload_s"]
        offline_at = r["until"][np.searchsorted(r["ids"], ids)]  # seconds after the start it goes offline
        deadline = self.cfg.deadline_s if self.cfg.deadline_s is not None else math.inf
        late, offline = t > deadline, (offline_at < t) & ~(t > deadline)
        dropped = late | offline
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
        fate = np.where(arrived, "aggregated", np.where(late, "dropout_deadline",
                                                        np.where(offline, "dropout_offline", "straggler")))
        r["events"] = events(ids, r["start"], r["start"] + settled, parts, fate, lost=np.setdiff1d(r["ids"], ids))
        if self.oort is not None:
            self.oort.feedback(r["round"], r["ids"], ids[arrived], np.asarray(utility, dtype=np.float64)[arrived],
                               t[arrived], wait)
        self._count_dry(int(arrived.sum()), int(late.sum()), int(offline.sum()), float(t.min()) if t.size else math.inf)
        if self.dry["rounds"] >= DRY_ROUNDS:
            raise self.no_arrivals(f"round {r.get('round', '?')}: no upload arrived in {DRY_ROUNDS} rounds in a row")
        return [int(c) for c in ids[arrived]]

    def _count_dry(self, arrived: int, late: int, offline: int, fastest: float) -> None:
        d = self.dry
        if arrived:
            self.dry = {"rounds": 0, "late": 0, "offline": 0, "fastest": math.inf}
        else:
            d.update(rounds=d["rounds"] + 1, late=d["late"] + late, offline=d["offline"] + offline,
                     fastest=min(d["fastest"], fastest))

    def no_arrivals(self, where: str, late: int | None = None, offline: int | None = None,
                    fastest: float | None = None) -> RunFailure:
        """The stop of a run in which uploads keep being lost: why (past the deadline, offline first) and the key
        to change for each; not resumable as it is (the same config loses them again). Counts default to the
        synchronous rounds' own (:attr:`dry`)."""
        late = self.dry["late"] if late is None else late
        offline = self.dry["offline"] if offline is None else offline
        fastest = self.dry["fastest"] if fastest is None else fastest
        causes = []
        if late:
            causes.append(f"{late} finished after system.deadline_s={self.cfg.deadline_s:g} s (the fastest in "
                          f"{fastest:.1f} s): raise system.deadline_s")
        if offline:
            key = {"markov": "system.mean_online_s", "trace": "system.availability_trace",
                   "fedscale": "system.availability_trace"}.get(self.cfg.availability, "system.availability")
            causes.append(f"{offline} went offline before they finished: give the clients longer online periods "
                          f"({key})")
        return RunFailure(f"{where}; " + "; ".join(causes or ["no client finished its work"]), resumable=False)

    def end_round(self, server_samples: float) -> dict[str, float]:
        """Moves the clock past the round and the server's work; the round's ``sim/*`` figures."""
        r, self._round = self._round, None
        assert r is not None and "wait" in r, "admit comes before end_round"
        self.last_events = r["events"]
        server_s = server_samples / self.cfg.server_sps if self.cfg.server_sps else 0.0
        round_s = r["waited"] + r["wait"] + server_s
        self.clock = r["start"] + r["wait"] + server_s
        return {"sim/round_s": round_s, "sim/clock_s": self.clock, "sim/available": float(r["available"]),
                "sim/selected": float(len(r["ids"])), "sim/stragglers": float(r["stragglers"]),
                "sim/dropouts": float(r["dropouts"] + r["lost"]), "sim/server_s": server_s,
                "sim/idle_s": r["waited"], **(self.oort.sim() if self.oort is not None else {})}

    def client_columns(self, client_ids) -> dict[str, np.ndarray]:
        """Per client of ``client_ids``: rounds aggregated and simulated busy seconds so far (clients.parquet)."""
        ids = np.asarray(client_ids, dtype=np.int64)
        return {"sim_rounds": self.rounds[ids].copy(), "sim_busy_s": self.busy_s[ids].copy()}

    def state(self) -> dict[str, Any]:
        return {"clock": self.clock, "rounds": self.rounds.copy(), "busy_s": self.busy_s.copy(),
                "availability": self.availability.state(), "dry": dict(self.dry),
                **({"oort": self.oort.state()} if self.oort is not None else {})}

    def load(self, state: dict[str, Any]) -> None:
        self.clock = float(state["clock"])
        self.rounds, self.busy_s = array(state["rounds"], np.int64), array(state["busy_s"], np.float64)
        self.availability.load(state["availability"])
        self.dry = dict(state.get("dry", self.dry))  # a checkpoint from before the count: none in a row
        if self.oort is not None:
            self.oort.load(state["oort"])
