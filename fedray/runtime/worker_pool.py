"""The Ray runtime's pool of ``ClientWorker`` actors: which process and node each is, the dataset reference they
were given, and their health.

A worker that failed a task is *suspect*; before the next round (or evaluation) the pool asks each suspect to
answer: one that restarted in place is given the dataset again (its constructor arguments are small, so it can
restart even when the dataset's object was lost: the pool puts the data anew), one that does not come back within
``READY_TIMEOUT_S`` is removed and the pool shrinks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from fedray.errors import RunFailure
from fedray.runtime.actors import READY_TIMEOUT_S, SYSTEM_ERRORS, WORKER_ERRORS

log = logging.getLogger("fedray")


class WorkerPool:
    """``size`` workers from ``new_worker()``, started at once (they import torch while the driver loads data)."""

    def __init__(self, new_worker: Callable[[], Any], size: int):
        self.workers: list = [new_worker() for _ in range(size)]
        self.pids: list[int] = []
        self.nodes: list[str] = []
        self.suspect: set[int] = set()  # workers that failed a task: checked before the next round
        self.data: Any = None  # the driver's copy: re-put if the object store loses it
        self.data_ref: ray.ObjectRef | None = None

    def put(self, data: Any) -> ray.ObjectRef:
        """The dataset in the object store, once; its reference is what every actor is given."""
        self.data, self.data_ref = data, ray.put(data)
        return self.data_ref

    def attach_all(self) -> None:
        """Give every worker the dataset (``put`` first); returns when all are ready."""
        ready = self._attach(self.workers)
        self.pids = [pid for pid, _ in ready]
        self.nodes = [node for _, node in ready]

    def _attach(self, workers: list) -> list[tuple[int, str]]:
        """Give workers the dataset; (pid, node) of each. The dataset's object is put again if it was lost."""
        for attempt in range(2):
            try:
                return [(pid, node) for pid, node, _ in ray.get([w.attach.remote(self.data_ref) for w in workers])]
            except ray.exceptions.ObjectLostError:
                if attempt:
                    raise
                log.warning("the dataset's object was lost from the object store; putting it again")
                self.data_ref = ray.put(self.data)
        raise AssertionError("unreachable")

    def check(self) -> bool:
        """Keep suspect workers that came back (restarted in place, given the dataset again); drop those that
        cannot. True if the pool shrank."""
        shrank = False
        for idx in sorted(self.suspect, reverse=True):
            back = self.revive(self.workers[idx])
            if back is not None:
                self.pids[idx], self.nodes[idx] = back
            else:
                log.warning("client worker %d did not come back; the pool shrinks to %d", idx, len(self.workers) - 1)
                ray.kill(self.workers[idx], no_restart=True)
                for lst in (self.workers, self.pids, self.nodes):
                    del lst[idx]
                shrank = True
        self.suspect.clear()
        if not self.workers:
            raise RunFailure("no client worker is left (all died and none could restart); resume from the last "
                             "checkpoint once the cluster has capacity again")
        return shrank

    def revive(self, worker) -> tuple[int, str] | None:
        """(pid, node) once the worker answers with the dataset attached; None if it is dead or not back within
        READY_TIMEOUT_S."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                pid, node, attached = ray.get(worker.ready.remote(), timeout=left)
                return (pid, node) if attached else self._attach([worker])[0]
            except ray.exceptions.ActorUnavailableError:  # restarting: ask again shortly
                time.sleep(0.5)
            except (ray.exceptions.GetTimeoutError, *SYSTEM_ERRORS):
                return None
        return None

    def run_on_all(self, submit: Callable[[list], list], what: str) -> list:
        """``ray.get`` of the tasks ``submit(workers)`` starts on the (checked) pool; a worker lost mid-way costs
        one rerun of them all once the pool is checked again."""
        for attempt in range(2):
            self.check()
            try:
                return ray.get(submit(self.workers))
            except WORKER_ERRORS as e:
                if attempt:
                    raise RunFailure(f"{what} failed twice: a client worker was lost ({type(e).__name__})") from None
                log.warning("%s lost a client worker (%s); rerunning it", what, type(e).__name__)
                self.suspect.update(range(len(self.workers)))
        raise AssertionError("unreachable")

    def kill(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
