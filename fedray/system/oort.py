"""Oort's guided participant selection (Lai et al., "Oort: Efficient Federated Learning via Guided Participant
Selection", OSDI 2021, Sec. 4 and Algorithm 1), as a synchronous round's sampler on the simulated clock.

Oort treats each client as a bandit arm. A client that has reported is scored

    Util(i) = U(i) + sqrt(0.1 log R / L(i))                     (statistical utility + temporal uncertainty)
    Util(i) <- Util(i) x (T / t_i) ** alpha   when t_i > T     (system utility: slower than the preferred T)

with U(i) = |B_i| sqrt(1/|B_i| sum_{k in B_i} Loss(k)^2) the client's last reported statistical utility (its
samples B_i and their per-sample losses, Sec. 4.2), L(i) the round it last reported, R the current round and t_i
the duration the server last measured for it. Each round it exploits (1 - eps) K clients, admitted above a cut-off
c x the (1 - eps) K-th highest utility and sampled among those with probability proportional to utility, and
explores eps K clients it has not heard from; eps decays each round to a floor. A pacer relaxes T when the
exploited utility stops growing, and a blacklist can retire clients picked too often.

Only what a real server knows is used: the sizes clients declare when they register, the utilities and durations
uploads brought in earlier rounds, and, for a selected client whose upload never arrived, that it took at least as
long as the server waited for it. Draws come from a stream of (run seed, "oort", round), and the whole selector
state is in the checkpoint, so a resumed run selects exactly as the uninterrupted one.

Where the paper and FedScale's released selector (``thirdparty/oort/oort.py``) differ, the paper is the default
and FedScale's choice an option, named ``fedscale`` (docs/system.md has the list). Utilities are normalised as
FedScale does (the paper leaves the scale out): clipped at the ``clip`` quantile of the candidates' utilities and
mapped to ``(U - 0.999 min) / range``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from fedray.seeding import derive_rng
from fedray.system.availability import array

#: The key of a client's info under which it reports its statistical utility U(i) (the worker computes it when
#: ``system.selection=oort``).
UTILITY = "stat_utility"


class OortConfig(BaseModel):
    """``system.oort.*``: Oort's knobs; defaults are FedScale's shipped values where the paper gives none."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    alpha: float = Field(default=2.0, ge=0, description="the straggler penalty: a client slower than T has its "
                         "utility multiplied by (T / t_i) ** alpha (FedScale's round_penalty)")
    round_percentile: float = Field(default=30.0, gt=0, le=100, description="the preferred round duration T: this "
                                    "percentile of the durations the server has measured (FedScale's "
                                    "round_threshold); 100: no system penalty")
    pacer: Literal["paper", "fedscale"] = Field(default="paper", description="paper: every pacer_step rounds, T's "
                                                "percentile rises by pacer_delta when the exploited utility of the "
                                                "last pacer_step rounds fell below that of the pacer_step before "
                                                "(Algorithm 1); fedscale: rises when it changed by 10 % or less, "
                                                "falls when it changed 5-fold")
    pacer_step: int = Field(default=20, ge=1, description="the pacer's window W, rounds")
    pacer_delta: float = Field(default=5.0, gt=0, description="the pacer's step of T's percentile")
    exploration: float = Field(default=0.9, ge=0, le=1, description="the initial exploration factor eps: the share "
                               "of K given to clients not yet heard from")
    exploration_decay: float = Field(default=0.98, gt=0, le=1, description="eps is multiplied by this each round")
    exploration_min: float = Field(default=0.3, ge=0, le=1, description="eps never falls below this")
    cutoff: float = Field(default=0.95, gt=0, le=1, description="exploitation admits clients whose utility is at "
                          "least this times the (1 - eps) K-th highest (the paper's c = 95 %; FedScale ships 0.05)")
    pool_factor: float = Field(default=0.0, ge=0, description="exploitation admits at least this many times "
                               "(1 - eps) K clients whatever the cut-off (0: the paper; FedScale: 10)")
    clip: float = Field(default=0.9, gt=0, le=1, description="utilities are clipped at this quantile of the "
                        "candidates' before normalising (FedScale's clip_bound)")
    sample_window: float = Field(default=5.0, ge=1, description="exploration samples among the sample_window x "
                                 "(its share) unexplored clients of largest declared size (FedScale's)")
    blacklist_rounds: int | None = Field(default=None, ge=1, description="a client whose upload arrived in more "
                                         "than this many rounds is no longer selected (at most blacklist_max of all clients); "
                                         "null: no blacklist")
    blacklist_max: float = Field(default=0.3, ge=0, le=1, description="the blacklist holds at most this share of "
                                 "the clients")


class Oort:
    """The selector's state over all registered clients (arrays: 100,000 clients cost megabytes) and its rounds."""

    def __init__(self, cfg: OortConfig, num_clients: int, seed: int):
        self.cfg, self.seed, self.num_clients = cfg, seed, num_clients
        self.utility = np.ones(num_clients)  # last reported U(i); before any report, its declared size
        self.duration = np.zeros(num_clients)  # last measured t_i (a lower bound for uploads that never came)
        self.timed = np.zeros(num_clients, dtype=bool)  # whether the server has measured a duration at all
        self.last = np.zeros(num_clients, dtype=np.int64)  # L(i): the round it last reported; 0: never
        self.picked = np.zeros(num_clients, dtype=np.int64)  # rounds its upload arrived (the blacklist's count)
        self.eps = cfg.exploration
        self.percentile = cfg.round_percentile
        self.exploit_utility: list[float] = []  # per round, the mean utility of its exploited clients that reported
        self.last_pick: dict[str, np.ndarray] = {"exploit": np.zeros(0, np.int64), "explore": np.zeros(0, np.int64)}
        self.reported = np.zeros(0, np.int64)  # the last round's clients whose upload arrived
        self.preferred_s = math.inf  # T of the last selection

    def register(self, sizes: np.ndarray) -> None:
        """The sizes clients declare when they register (FedScale's register_client): the utility an unexplored
        client is ranked by."""
        fresh = self.last == 0
        self.utility[fresh] = np.asarray(sizes, dtype=np.float64)[fresh]

    # ---------------------------------------------------------------------------------------------- selection

    def select(self, round_: int, online: np.ndarray, k: int) -> np.ndarray:
        """``k`` clients of ``online`` (sorted ids) for round ``round_`` (>= 1), sorted."""
        cfg, rng = self.cfg, derive_rng(self.seed, "oort", round_)
        self._pace(round_)
        feasible = np.setdiff1d(online, self.blacklist(), assume_unique=True)
        known = self.duration[self.timed]
        self.preferred_s = (math.inf if self.percentile >= 100 or not known.size
                            else float(np.sort(known)[min(int(known.size * self.percentile / 100), known.size - 1)]))
        self.eps = max(self.eps * cfg.exploration_decay, cfg.exploration_min)
        explored = feasible[self.last[feasible] > 0]
        fresh = feasible[self.last[feasible] == 0]
        n_explore = min(int(k * self.eps), fresh.size)
        n_exploit = min(k - n_explore, explored.size)
        n_explore = min(k - n_exploit, fresh.size)  # too few explored: exploration takes the rest, and vice versa
        exploit = self._exploit(round_, explored, n_exploit, rng)
        explore = self._explore(fresh, n_explore, rng)
        self.last_pick = {"exploit": exploit, "explore": explore}
        return np.sort(np.concatenate([exploit, explore]))

    def take_all(self, chosen: np.ndarray) -> None:
        """A round that selects every online client (no more online than it selects) consults no score, as
        FedScale's; its clients count as exploited if heard from before, explored otherwise."""
        heard = self.last[chosen] > 0
        self.last_pick = {"exploit": chosen[heard], "explore": chosen[~heard]}

    def scores(self, round_: int, ids: np.ndarray) -> np.ndarray:
        """Util(i) of explored clients ``ids`` at round ``round_`` (module docstring), normalised among them."""
        u = self.utility[ids]
        pos = np.sort(u[u > 0])
        if pos.size:
            clip = pos[min(int(pos.size * self.cfg.clip), pos.size - 1)]
            low = pos[0] * 0.999
            span = max(pos[-1] - low, 1e-4)
        else:
            clip, low, span = 0.0, 0.0, 1.0
        stat = (np.minimum(u, clip) - low) / span
        temporal = np.sqrt(0.1 * math.log(round_) / self.last[ids])
        return np.abs((stat + temporal) * self.penalty(ids))

    def penalty(self, ids: np.ndarray) -> np.ndarray:
        """(T / t_i) ** alpha for clients slower than the preferred duration T, else 1."""
        t = self.duration[ids]
        slow = self.timed[ids] & (t > self.preferred_s)
        out = np.ones(ids.size)
        out[slow] = (self.preferred_s / np.maximum(t[slow], 1e-4)) ** self.cfg.alpha
        return out

    def _exploit(self, round_: int, ids: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` of ``ids``: those at or above the cut-off admitted (at least pool_factor x n), then sampled by
        utility without replacement."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        sc = self.scores(round_, ids)
        order = np.lexsort((ids, -sc))  # highest first, ties to the lower id
        ids, sc = ids[order], sc[order]
        admitted = self.admitted(sc, n)
        return self._draw(ids[:admitted], sc[:admitted], n, rng)

    def admitted(self, sc: np.ndarray, n: int) -> int:
        """How many of the scores ``sc`` (highest first) exploitation draws ``n`` from: those at or above ``cutoff``
        times the n-th highest, at least ``n`` and at least ``pool_factor`` x n (FedScale's pool) of them."""
        cut = self.cfg.cutoff * sc[n - 1]
        return max(int(np.sum(sc >= cut)), n, min(sc.size, math.ceil(self.cfg.pool_factor * n)))

    def _explore(self, ids: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` of the unexplored ``ids``: among the sample_window x n of largest declared size (penalised by a
        duration the server already knows of them), sampled by it."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        weight = self.utility[ids] * self.penalty(ids)
        order = np.lexsort((ids, -weight))
        window = order[: min(int(self.cfg.sample_window * n), ids.size)]
        return self._draw(ids[window], weight[window], n, rng)

    @staticmethod
    def _draw(ids: np.ndarray, weight: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        if n >= ids.size:
            return ids.copy()
        w = np.maximum(weight, 1e-12)  # a zero weight may still be drawn once the others are taken
        return rng.choice(ids, size=n, replace=False, p=w / w.sum())

    def blacklist(self) -> np.ndarray:
        """Clients whose upload arrived in more than ``blacklist_rounds`` rounds, most first, at most
        blacklist_max of all (FedScale's count of a client's feedbacks)."""
        if self.cfg.blacklist_rounds is None:
            return np.zeros(0, dtype=np.int64)
        over = np.flatnonzero(self.picked > self.cfg.blacklist_rounds)
        over = over[np.lexsort((over, -self.picked[over]))]
        return np.sort(over[: int(self.cfg.blacklist_max * self.num_clients)])

    def _pace(self, round_: int) -> None:
        """Records the last round's exploited utility and, every pacer_step rounds, moves T's percentile."""
        if round_ == 1:
            return
        mine = np.intersect1d(self.last_pick["exploit"], self.reported)
        self.exploit_utility.append(float(self.utility[mine].sum() / (mine.size + 1e-4)))
        w, hist = self.cfg.pacer_step, self.exploit_utility
        # two windows of history (one entry a round from round 2 at most) means round_ > 2 W already
        if not (round_ % w == 0 and len(hist) >= 2 * w):
            return
        before, now = sum(hist[-2 * w:-w]), sum(hist[-w:])
        step = self.cfg.pacer_delta
        if self.cfg.pacer == "paper":
            if before > now:
                self.percentile = min(100.0, self.percentile + step)
        elif abs(now - before) <= 0.1 * before:
            self.percentile = min(100.0, self.percentile + step)
        elif abs(now - before) >= 5 * before:
            self.percentile = max(step, self.percentile - step)

    # ---------------------------------------------------------------------------------------------- feedback

    def feedback(self, round_: int, selected: np.ndarray, arrived: np.ndarray, utility: np.ndarray,
                 duration: np.ndarray, waited: float) -> None:
        """After round ``round_``: the clients whose upload arrived (``arrived``, with their reported ``utility``
        and measured ``duration``) and the other ``selected`` ones, of which the server knows only that each took
        longer than ``waited`` (its duration becomes at least that)."""
        arrived = np.asarray(arrived, dtype=np.int64)
        self.utility[arrived] = utility
        self.duration[arrived] = duration
        self.last[arrived] = round_
        self.picked[arrived] += 1
        silent = np.setdiff1d(np.asarray(selected, dtype=np.int64), arrived)
        self.duration[silent] = np.where(self.timed[silent], np.maximum(self.duration[silent], waited), waited)
        self.timed[arrived] = self.timed[silent] = True
        self.reported = arrived

    def sim(self) -> dict[str, float]:
        """The selection's own figures of the round (``sim/oort_*``)."""
        out = {"sim/oort_explored": float(self.last_pick["explore"].size), "sim/oort_exploration": self.eps}
        if math.isfinite(self.preferred_s):  # none before any duration is known (no system penalty yet)
            out["sim/oort_preferred_s"] = self.preferred_s
        return out

    # ---------------------------------------------------------------------------------------------- checkpoint

    def state(self) -> dict[str, Any]:
        return {"utility": self.utility.copy(), "duration": self.duration.copy(), "timed": self.timed.copy(),
                "last": self.last.copy(), "picked": self.picked.copy(), "eps": self.eps,
                "percentile": self.percentile, "exploit_utility": list(self.exploit_utility),
                "exploit": self.last_pick["exploit"].copy(), "explore": self.last_pick["explore"].copy(),
                "reported": self.reported.copy(), "preferred_s": self.preferred_s}

    def load(self, state: dict[str, Any]) -> None:
        self.utility, self.duration = array(state["utility"], np.float64), array(state["duration"], np.float64)
        self.timed, self.last = array(state["timed"], bool), array(state["last"], np.int64)
        self.picked = array(state["picked"], np.int64)
        self.eps, self.percentile = float(state["eps"]), float(state["percentile"])
        self.exploit_utility = [float(u) for u in state["exploit_utility"]]
        self.last_pick = {"exploit": array(state["exploit"], np.int64), "explore": array(state["explore"], np.int64)}
        self.reported, self.preferred_s = array(state["reported"], np.int64), float(state["preferred_s"])
