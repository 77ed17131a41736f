"""The Ray runtime's part for ``federation.mode=async``: a task per client, started as soon as the model it trains
from is known; the driver's schedule (:mod:`fedray.system.schedule`) takes the results in simulated-time order."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import ray

from fedray.errors import RunFailure
from fedray.runtime.actors import WORKER_ERRORS

log = logging.getLogger("fedray")


@dataclass
class Job:
    """A client's task on a worker: its result's object references (the synchronous rounds' tasks too)."""

    client_id: int
    worker: int
    upload: Any
    state: Any
    info: Any
    attempt: int
    deadline: float
    batch: tuple[int, ...] = ()  # the clients trained with it in one task (vectorised), itself included


class AsyncTasks:
    """:class:`~fedray.runtime.base.Runtime`'s async methods on Ray, for :class:`~fedray.runtime.ray_runtime.RayRuntime`
    (its pool, server, client states and config); ``_flight``, ``_tasks`` and ``_versions`` are its own."""

    _flight: dict[int, Job]  # each training client's task
    _tasks: dict[int, tuple[int, int]]  # each training client's (round, server version)
    _versions: dict[int, tuple[ray.ObjectRef, int]]  # payloads by server version, and their bytes

    def submit(self, round_: int, client_id: int, version: int) -> int:
        if version not in self._versions:
            self._versions[version] = self.server.payload_of(version)
        load = [0] * len(self.pool.workers)
        for job in self._flight.values():
            load[job.worker] += 1
        worker = min(range(len(load)), key=lambda w: (load[w], w))  # the least busy worker
        self._start(round_, client_id, version, worker, 0)
        return self._versions[version][1]

    def _start(self, round_: int, client_id: int, version: int, worker: int, attempt: int) -> None:
        up, st, info = self.pool.workers[worker].train_many.options(num_returns=3).remote(
            round_, [client_id], self._versions[version][0], self.client_states.get(client_id))
        self._flight[client_id] = Job(client_id, worker, up, st, info, attempt, math.inf)
        self._tasks[client_id] = (round_, version)

    def finished(self, client_id: int) -> dict:
        """The client's info; a task whose worker died is run again, from the same inputs, on that worker once it
        has restarted (up to ``runtime.max_client_retries`` times): its figures are the ones it would have had."""
        while True:
            job = self._flight[client_id]
            try:
                return ray.get(job.info)
            except WORKER_ERRORS as e:
                worker = job.worker if job.worker < len(self.pool.workers) else 0  # the pool may have shrunk since
                if job.attempt >= self.cfg.runtime.max_client_retries or self.pool.revive(
                        self.pool.workers[worker]) is None:
                    raise RunFailure(f"client {client_id}'s worker failed during an asynchronous task "
                                     f"({type(e).__name__}) {job.attempt + 1} time(s); resume the run from its last "
                                     "checkpoint") from None
                log.warning("client %d lost its worker during an asynchronous task (%s); rerunning it on worker %d",
                            client_id, type(e).__name__, worker)
                round_, version = self._tasks[client_id]
                self._start(round_, client_id, version, worker, job.attempt + 1)

    def discard(self, client_id: int) -> None:
        del self._flight[client_id], self._tasks[client_id]

    def apply(self, round_, client_ids, versions, weights, live):
        jobs = [self._flight.pop(c) for c in client_ids]
        for cid in client_ids:
            del self._tasks[cid]
        receipt = self.server.receive(client_ids, [j.upload for j in jobs])
        for cid in client_ids:
            if not self.server.confirm(receipt, cid, round_):
                raise RunFailure(f"round {round_}: client {cid}'s upload was lost with its node; resume the run "
                                 "from its last checkpoint")
        metrics = self.server.aggregate_stale(round_, client_ids, versions, weights, live)
        infos = ray.get([j.info for j in jobs])
        for job, info in zip(jobs, infos):
            if info.get("has_state", True):
                self.client_states[job.client_id] = job.state
        kept = set(live)
        self._versions = {v: x for v, x in self._versions.items() if v in kept}
        return infos, metrics

    def sent_payloads(self) -> dict:
        return self.server.call("sent_payloads")

    def load_sent_payloads(self, sent: dict) -> None:
        self.server.call("load_sent_payloads", sent)
        self._versions = {}
